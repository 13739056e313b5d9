"""Text output of ``pipeserve plan``: inputs, symbols, formulas, memory, recommendation."""

from __future__ import annotations

from pipeserve.plan.analysis import PlanEstimate
from pipeserve.plan.hardware import Hardware

SYMBOLS = """Symbols
  P        pipeline stages (workers);  T  tensor-parallel ranks per stage;  V  chunks per worker (interleaved)
  L        decoder layers;  H_kv  KV heads;  D_head  head dim;  bytes  bytes per element (dtype)
  S        tokens per sequence (S_in prompt + S_out generated);  B  sequences decoding at once
  N (=K)   micro-batches in flight (async) or per step (gpipe M);  b = ceil(B / N) sequences per micro-batch
  t_stage  slowest stage's forward for one decode micro-batch (the DESIGN's t_layer)
  t_comm   slowest activation hop between stages for one micro-batch ([b, hidden] · bytes)
  eta      pipeline efficiency = N·t_stage / (N·t_stage + (P-1)·t_stage + (P-1)·t_comm)
  alpha    communication overhead per stage boundary = t_comm / (P·t_stage)
  gain     throughput over one device ~ P·eta / (1 + alpha·(P-1))
  B_opt    argmin_B (P·t_fwd(B) + (P-1)·t_comm(B)) / B, the micro-batch size cheapest per token
  M_KV     2·L·H_kv·D_head·B·S·bytes
  T        T_queue + T_prefill + T_decode + T_comm; T_decode = (S_out-1)·P·t_stage"""


def _gb(x: float) -> str:
    return f"{x / 1e9:8.2f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms"


def format_hardware(hw: Hardware) -> str:
    return (f"Hardware {hw.name}: {hw.flops_prefill / 1e12:.1f} TFLOP/s prefill, "
            f"{hw.flops_decode / 1e12:.1f} TFLOP/s decode, {hw.mem_bandwidth / 1e9:.0f} GB/s, "
            f"{hw.mem_bytes / 1e9:.1f} GB ({hw.memory_utilization:.0%} usable, "
            f"{hw.reserved_bytes / 1e9:.1f} GB reserved), {hw.gpus_per_node}/node; links: "
            f"intra {hw.intra_node_bandwidth / 1e9:.1f} GB/s + {hw.intra_node_latency * 1e6:.0f} us, "
            f"inter {hw.inter_node_bandwidth / 1e9:.1f} GB/s + {hw.inter_node_latency * 1e6:.0f} us; "
            f"dtype {hw.dtype}")


def format_estimate(est: PlanEstimate, title: str) -> str:
    r = est.req
    lines = [f"{title}: PP={r.pp} x TP={r.tp}, schedule {r.schedule}"
             + (f", weights {r.quantization}" if r.quantization else "")
             + (f", V={r.virtual_stages}" if r.virtual_stages > 1 else "")
             + f", partition {'/'.join(map(str, est.chunk_layers))} layers"]
    lines.append(f"  inputs: S_in={r.input_len} S_out={r.output_len} max_num_seqs={r.max_num_seqs} "
                 f"max_num_batched_tokens={r.max_num_batched_tokens}")
    lines.append(f"  B={est.batch} sequences (KV- and max_num_seqs-limited), N={est.micro_batches} "
                 f"micro-batches of b={est.micro_batch_size}")
    lines.append("  stage  layers  weights GB     KV GB    act GB  total GB  usable GB  fits  t_fwd(b)")
    for mem, t in zip(est.memory, est.t_stage):
        lines.append(f"  {mem.stage:5d}  {mem.layers:6d}  {_gb(mem.weights)}  {_gb(mem.kv)}  "
                     f"{_gb(mem.activations)}  {_gb(mem.total)}  {_gb(mem.usable)}  "
                     f"{'yes' if mem.fits else 'NO ':>4}  {_ms(t)}")
    lat = est.latency
    lines += [
        f"  t_stage={_ms(est.t_max)}  t_comm={_ms(est.t_comm)}  (return hop {_ms(est.t_return)})",
        f"  [1] eta = {est.micro_batches}·{_ms(est.t_max)} / ({est.micro_batches}·t + {r.pp - 1}·t + "
        f"{r.pp - 1}·t_comm) = {est.eta:.3f}",
        f"  [2] B_opt = {est.b_opt} ({est.b_opt_cost * 1e3:.4f} ms per sequence-token)",
        f"  [3] gain = {r.pp}·{est.eta:.3f} / (1 + {est.alpha:.4f}·{r.pp - 1}) = {est.gain:.2f}"
        f"   (alpha = t_comm / (P·t_stage) = {est.alpha:.4f})",
        f"  [4] M_KV = 2·L·H_kv·D_head·{est.batch}·{r.input_len + r.output_len}·bytes = "
        f"{est.kv_bytes / 1e9:.2f} GB (whole model, all stages)",
        f"  [5] T = {lat['T_queue']:.3f} + {lat['T_prefill']:.3f} + {lat['T_decode']:.3f} + "
        f"{lat['T_comm']:.3f} = {lat['T']:.3f} s  (TTFT {lat['TTFT']:.3f} s, TPOT {_ms(lat['TPOT'])})",
        f"  analytic decode throughput: {est.throughput:,.0f} output tokens/s (steady state, no error "
        "band: the simulation below is the validated prediction)",
    ]
    return "\n".join(lines)


def format_fewest_stages(est: PlanEstimate | None, weight_bytes: float, hw: Hardware) -> str:
    """How many stages of this hardware the model needs (``recommend.fewest_stages``)."""
    r = est.req if est else None
    fmt = f"{weight_bytes / 1e9:.2f} GB of weights"
    if est is None:
        return (f"Stages needed: none fits; {fmt} and one layer per stage already exceed "
                f"{hw.usable_bytes / 1e9:.1f} GB usable per device")
    return (f"Stages needed: {fmt} -> at least PP={r.pp} x TP={r.tp} of {hw.usable_bytes / 1e9:.1f} GB usable "
            f"each (partition {'/'.join(map(str, est.chunk_layers))} layers, KV room for B={est.batch} "
            f"sequences of {r.input_len + r.output_len} tokens)")


def format_candidates(results: list[PlanEstimate], best: PlanEstimate | None, target: str) -> str:
    lines = [f"Candidates (same device count), target {target}:",
             "  PP x TP   fits  N   B     tokens/s   T (s)   TPOT ms  eta    gain"]
    for est in results:
        mark = " <- recommended" if est is best else ""
        lines.append(f"  {est.req.pp:2d} x {est.req.tp:<2d}  {'yes' if est.fits else 'NO ':>4}  "
                     f"{est.micro_batches:<3d} {est.batch:<5d} {est.throughput:10,.0f}  "
                     f"{est.latency['T']:6.2f}  {est.latency['TPOT'] * 1e3:8.2f}  {est.eta:.3f}  "
                     f"{est.gain:5.2f}{mark}")
    return "\n".join(lines)


def explain(best: PlanEstimate | None, results: list[PlanEstimate], target: str) -> str:
    if best is None:
        return ("Recommendation: nothing fits. Every split runs out of memory; use more devices, "
                "a smaller dtype or --quantization, or a device with more memory.")
    r = best.req
    why = {"throughput": f"the most output tokens/s ({best.throughput:,.0f})",
           "latency": f"the shortest request latency ({best.latency['T']:.2f} s)"}[target]
    others = [e for e in results if e is not best and e.fits]
    lines = [f"Recommendation: PP={r.pp} x TP={r.tp}, {best.micro_batches} micro-batches, "
             f"partition {','.join(map(str, best.chunk_layers))}: {why} among {len(others) + 1} "
             f"fitting splits."]
    if r.tp > 1:
        lines.append(f"  TP={r.tp} keeps tensor parallelism inside a node (its all-reduces need the "
                     "fast intra-node link); PP spans nodes, where one activation hop per stage is cheap.")
    lines.append(f"  N={best.micro_batches} keeps the slowest stage busy: a micro-batch's round trip "
                 f"(sum of stages + hops) divided by t_stage; b={best.micro_batch_size}.")
    return "\n".join(lines)


def format_simulation(summaries: list[dict]) -> str:
    """The simulated schedules, each throughput with the range the hardware file's held-out
    validation puts the measured one in (predicted / measured within [low, high] there)."""
    band = summaries[0].get("validated_ratio") if summaries else None
    lines = ["Simulation (discrete-event, continuous batching, the runtime's scheduler):",
             "  schedule     out tok/s  expected range     req/s  TTFT p50/p99 (s)   TPOT p50/p99 (ms)   "
             "bubble per stage"]
    for s in summaries:
        bubbles = " ".join(f"{b:.2f}" for b in s["bubble_ratio"])
        tok = s["output_tokens_per_s"]
        rng = f"{tok / band[1]:,.0f}-{tok / band[0]:,.0f}" if band else "not validated"
        lines.append(f"  {s['schedule']:<11} {tok:10,.0f}  {rng:<17} {s['requests_per_s']:7.2f}  "
                     f"{s['ttft_s']['p50']:7.3f}/{s['ttft_s']['p99']:<7.3f}  "
                     f"{s['tpot_s']['p50'] * 1e3:8.2f}/{s['tpot_s']['p99'] * 1e3:<8.2f}  {bubbles}")
    lines.append(expected_error(band))
    return "\n".join(lines)


def expected_error(band: tuple[float, float, int] | None) -> str:
    """One line: how far from a measurement this hardware file's predictions have been."""
    if not band:
        return ("  expected error: not validated for this hardware (no held-out runs measured with it; "
                "on the 2-core CPU host see python -m pipeserve.plan.validate --heldout)")
    low, high, runs = band
    return (f"  expected error: the measured out tok/s was within {100 * (1 / high - 1):+.0f}% to "
            f"{100 * (1 / low - 1):+.0f}% of the prediction on {runs} held-out runs with this hardware file "
            f"(predicted / measured {low:.2f}-{high:.2f}; python -m pipeserve.plan.validate --heldout)")
