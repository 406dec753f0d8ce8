"""Context-parallel GDN/KDA on several GPUs (NCCL): parity with one GPU, and scaling at T = 131072.

    python3 scripts/cp_scaling.py [gdn|kda] [--T 131072] [--gpus 2] [--reps 10]

Needs a machine with >= --gpus GPUs (the device tool's nvidia-h200-x2 / -x4 kinds). One process per
GPU (torch.multiprocessing, NCCL); NVLink multicast stays off as the machines require
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, set here too).
Prints, per rank count 1 and --gpus: forward and forward+backward medians (CUDA events over
--reps calls, after warm-up), the speedup over one GPU (the goal: >= 1.8 on 2 GPUs), and the rel
error of o and dq/dk against the one-GPU op on the same inputs. Written 2026-11-29, not yet run:
no multi-GPU kind was lent that day.
"""

import argparse
import os
import socket
import statistics

for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = val

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, H, K, V = 1, 16, 128, 128


def inputs(op, T, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    q, k, v = mk(B, T, H, K).bfloat16(), mk(B, T, H, K).bfloat16(), mk(B, T, H, V).bfloat16()
    g = F.logsigmoid(mk(*((B, T, H, K) if op == "kda" else (B, T, H))))
    beta = torch.rand(B, T, H, generator=gen).to(device)
    do = mk(B, T, H, V).bfloat16()
    return q, k, v, g, beta, do


def timed(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier() if dist.is_initialized() else None
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def worker(rank, world, port, op_name, T, reps, out):
    import tileport
    from tileport.context_parallel import context_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    op = {"gdn": tileport.chunk_gated_delta_rule, "kda": tileport.chunk_kda}[op_name]
    q, k, v, g, beta, do = inputs(op_name, T, f"cuda:{rank}")
    a, b = rank * T // world, (rank + 1) * T // world
    loc = [x[:, a:b].contiguous().requires_grad_(True) for x in (q, k, v, g, beta)]

    def fwd():
        with torch.no_grad():
            context_parallel(op, *loc, use_qk_l2norm_in_kernel=True)

    def fwdbwd():
        o, _ = context_parallel(op, *loc, use_qk_l2norm_in_kernel=True)
        o.backward(do[:, a:b])

    t_f, t_fb = timed(fwd, reps), timed(fwdbwd, reps)
    for x in loc:
        x.grad = None
    o, _ = context_parallel(op, *loc, use_qk_l2norm_in_kernel=True)
    o.backward(do[:, a:b])
    torch.save(dict(fwd=t_f, fwdbwd=t_fb, o=o.detach().cpu(), dq=loc[0].grad.cpu(), dk=loc[1].grad.cpu()),
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op", nargs="?", default="gdn", choices=["gdn", "kda"])
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import tempfile

    results = {}
    for world in (1, args.gpus):
        with tempfile.TemporaryDirectory() as out:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(worker, args=(world, port, args.op, args.T, args.reps, out), nprocs=world, join=True)
            parts = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
        results[world] = dict(fwd=max(p["fwd"] for p in parts), fwdbwd=max(p["fwdbwd"] for p in parts),
                              o=torch.cat([p["o"] for p in parts], 1), dq=torch.cat([p["dq"] for p in parts], 1),
                              dk=torch.cat([p["dk"] for p in parts], 1))
    one, many = results[1], results[args.gpus]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    print(f"{args.op} B={B} T={args.T} H={H} K=V={K} bf16")
    for mode in ("fwd", "fwdbwd"):
        print(f"  {mode:7s} 1 GPU {one[mode]:8.3f} ms   {args.gpus} GPUs {many[mode]:8.3f} ms   "
              f"speedup x{one[mode] / many[mode]:.2f}")
    print(f"  rel err vs 1 GPU: o {rel(many['o'], one['o']):.2e}  dq {rel(many['dq'], one['dq']):.2e}  "
          f"dk {rel(many['dk'], one['dk']):.2e}")


if __name__ == "__main__":
    main()
