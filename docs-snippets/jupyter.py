# %%
from aiorouter import default_router
router = await default_router().start()    # top-level await: the notebook's event loop runs the router

# %%
question = [{"role": "user", "content": "What is the capital of France?"}]
async for ev in router.stream(question, max_tokens=32):
    print(ev.text, end="")

# %%
await router.close()                        # stops the model workers and frees their KV cache
