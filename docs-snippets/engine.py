from aiorouter import default_models
from engines import Engine
eng = Engine.from_pretrained(default_models()["large"].path, device="cpu", dtype="float32")
outs = eng.generate(["The capital of France is", [1, 2, 3]], max_tokens=32, temperature=0.0)  # vLLM's LLM.generate in spirit
print(outs[0].text)
