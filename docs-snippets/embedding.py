import asyncio
from aiorouter import default_router

async def main():
    async with default_router() as router:            # the embedded pair and the policy it is tuned for
        question = [{"role": "user", "content": "What is the capital of France?"}]
        async for ev in router.stream(question, max_tokens=32):        # a list of messages: chat
            print(ev.text, end="", flush=True)        # ev.token_id, ev.model tell who wrote it
        result = await router.generate("The capital of France is", max_tokens=8)  # a string: raw text
        print("\n" + result.text, result.usage["per_model"])

asyncio.run(main())   # aiorouter.run(main()) uses uvloop when it is installed
