import asyncio
from aiorouter import Router, RouterConfig, default_models
from policies import STAY, PeerReq, Policy

class LowConfidence(Policy):
    """The small model (0) hands a token to the large model (1) when its top-1 probability is
    below `threshold`; the large model writes that one token and hands straight back."""
    name, num_models, threshold = "low-confidence", 2, 0.9

    def route(self, result):                            # after each step, for the whole batch
        if result.model == 1:
            return [1] * len(result.reqs)               # large: back to its 1st peer, the small model
        top1 = result.logits.softmax(-1).max(-1).values
        return [1 if p < self.threshold else STAY for p in top1.tolist()]

    def send(self, req):                                # what travels with a request that moves
        keep = [req.sampled] if req.model == 1 else []  # commit the large model's token, drop the small's
        return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + keep, loc=req.loc)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

async def main(models=None, prompt=QUESTION, policy=None):
    async with Router(models or default_models(), RouterConfig(policy=policy or LowConfidence())) as router:
        result = await router.generate(prompt, max_tokens=32)
        print(result.usage["per_model"], result.text)   # who wrote how many tokens, and the answer
        return result

if __name__ == "__main__":
    asyncio.run(main())
