# the clients in virtual environments of their own (lm-eval and vLLM each bring their own torch)
python -m venv ~/clients && ~/clients/bin/pip install 'lm-eval[api]' guidellm
python -m venv ~/vllm && ~/vllm/bin/pip install vllm
export PATH=~/clients/bin:$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
URL=http://127.0.0.1:8000   # a running `aiorouter serve`
TOK=$(curl -s $URL/v1/models | python -c "import json, sys; print(json.load(sys.stdin)['data'][0]['root'])")

# throughput and latency: 10 requests, 2 at a time, streamed chat
# (request_format=/v1/completions for completions, stream=false for whole answers)
guidellm run --backend kind=openai_http,target=$URL,request_format=/v1/chat/completions,stream=true \
    --profile kind=concurrent,streams=2 --constraint kind=max_requests,count=10 \
    --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 --tokenizer kind=huggingface_auto,model=$TOK

# quality: the repository's two small tasks (from its root); any lm-eval task where the hub is reachable
lm_eval --model local-completions --tasks aiorouter_gen,aiorouter_mc --include_path tests/clients_tasks \
    --model_args model=aiorouter,base_url=$URL/v1/completions,tokenizer=$TOK,num_concurrent=2
lm_eval --model local-chat-completions --apply_chat_template --tasks aiorouter_gen --include_path tests/clients_tasks \
    --model_args model=aiorouter,base_url=$URL/v1/chat/completions,num_concurrent=2

# vLLM's serving benchmark (its client alone: no GPU needed); --backend openai and /v1/completions for completions
~/vllm/bin/vllm bench serve --backend openai-chat --base-url $URL --endpoint /v1/chat/completions --model aiorouter \
    --tokenizer $TOK --dataset-name random --random-input-len 64 --random-output-len 16 --num-prompts 10 --max-concurrency 2
