from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
r = client.chat.completions.create(model="aiorouter", max_tokens=32, temperature=0,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
print(r.choices[0].message.content, r.usage.model_extra["per_model"])   # tokens written by each model
