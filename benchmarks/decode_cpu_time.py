"""Single-stream decode on the CPU clock, 1 thread (built-in Q4_1 SmolLM2, prompt 128 random ids,
256 greedy tokens): best decode tok/s over argv[1] rounds and a hash of the tokens, so two
trees run alternately (PYTHONPATH=<tree>) can be compared and checked token-identical."""
import random, sys, time
from pipeserve import LLM, SamplingParams
llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", quantization="auto", threads_per_stage=1)
prompt = [random.Random(0).randrange(100, 20000) for _ in range(128)]
def run(n):
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.process_time(); out = llm.generate([prompt], p, use_tqdm=False); return time.process_time() - t, out[0].outputs[0].token_ids
run(8)
best = 0
for _ in range(int(sys.argv[1])):
    t1, _ = run(1); t, ids = run(256)
    best = max(best, 255 / (t - t1))
print(f"decode {best:.1f} tok/s (cpu clock) ms/token {1000/best:.2f} tokens-hash {hash(tuple(ids))}")
