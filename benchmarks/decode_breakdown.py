"""Where a decode token's CPU time goes (1 thread, CPU clock): the same decode with the gemvs,
then attention, then norm/RoPE/SiLU replaced by stubs (outputs meaningless; needs QuantLinear._decode)."""
import random, sys, time, torch
from pipeserve import LLM, SamplingParams
from pipeserve.model.quant import modules as qm
llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", quantization="auto", threads_per_stage=1)
prompt = [random.Random(0).randrange(100, 20000) for _ in range(128)]
def run(n):
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.process_time(); llm.generate([prompt], p, use_tqdm=False); return time.process_time() - t
def rate():
    best = 1e9
    for _ in range(3):
        t1 = run(1); t = run(129); best = min(best, (t - t1) / 128 * 1000)
    return best
run(8)
runner = llm.engine.executor.runner
model = runner.model
lins = [m for m in model.modules() if isinstance(m, qm.QuantLinear)]
real = {m: m._decode for m in lins}
res = {}
res["full"] = rate()
for m in lins:
    buf = torch.zeros(1, m.out_features, dtype=torch.bfloat16)
    m._decode = (lambda b: (lambda x: b))(buf)
res["no gemv"] = rate()
be = model.backend
orig_fwd = type(be).forward
be.forward = lambda q, k, v, kv, meta, scale, **kw: q if q.shape[0] == 1 else orig_fwd(be, q, k, v, kv, meta, scale, **kw)
res["no gemv, no attention"] = rate()
ops = model.layers[0].input_layernorm.ops
orig = (ops.rmsnorm, ops.rope, ops.silu_mul)
ops.rmsnorm = lambda x, w, eps, r=None: (x, x) if x.shape[0] == 1 else orig[0](x, w, eps, r)
ops.rope = lambda x, c, s: x if x.shape[0] == 1 else orig[1](x, c, s)
ops.silu_mul = lambda g: g[:, :g.shape[1] // 2] if g.shape[0] == 1 else orig[2](g)
res["no gemv/attn/norm/rope/silu"] = rate()
for k, v in res.items():
    print(f"{k:32s} {v:6.2f} ms/token")
