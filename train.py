#!/usr/bin/env python3
"""Train GPT-2 with gpt2np: llm.c's train_gpt2 flags, on the CPU (NumPy) or a GPU (CUDA kernels + cuBLAS).

    python train.py                      # gpt2_124M.bin (fetched; offline: d12 random init) on tinyshakespeare
    python train.py -e d12 -b 4 -t 64 -x 20 -o log124M
    python train.py -e log124M/model_00000020.bin ...      # any llm.c model file
    python train.py -o log124M -y 1                        # resume from the latest checkpoint in -o
    mpiexec -n 8 python train.py -e d12 -z 1               # data parallel: 8 ranks (one GPU each), ZeRO-1
"""
import argparse
import sys


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("-i", metavar="PATTERN", help="train token shards (glob); default: tinyshakespeare, prepared on first use")
    a("-j", metavar="PATTERN", help="val token shards (glob); default: the train set's val split")
    a("-e", metavar="MODEL", default="gpt2_124M.bin",
      help="llm.c model file, or d12/d24/d36/d48 for random init (default gpt2_124M.bin, fetched if missing)")
    a("-o", metavar="DIR", help="output dir for main.log and checkpoints (default: none)")
    a("-b", type=int, help="micro batch size B (default 4)")
    a("-t", type=int, help="sequence length T (default 64 on the CPU, 1024 on a GPU)")
    a("-d", type=int, default=-1, help="total batch size in tokens, by gradient accumulation (default B*T*processes)")
    a("-x", type=int, help="max steps (-1 = one epoch; default 40 on the CPU, -1 on a GPU)")
    a("-l", type=float, default=3e-4, help="learning rate (default 3e-4)")
    a("-u", type=int, default=0, help="warmup iterations (default 0)")
    a("-q", type=float, default=1.0, help="final lr as a fraction of -l (default 1.0: no decay)")
    a("-k", default="cosine", choices=["cosine", "linear", "constant", "wsd"], help="lr schedule (default cosine)")
    a("-c", type=float, default=0.0, help="weight decay (default 0.0), on the 2-D tensors")
    a("-v", type=int, help="val loss every N steps (default 10 CPU / 20 GPU; 0 = never)")
    a("-m", type=int, help="max val batches (default 5 CPU / 20 GPU; -1 = all)")
    a("-s", type=int, help="sample every N steps (default 20; 0 = never)")
    a("-g", type=int, default=64, help="tokens to generate per sample (default 64)")
    a("-n", type=int, default=0, help="checkpoint every N steps into -o (default 0 = never)")
    a("-y", type=int, default=0, choices=[0, 1], help="1 = resume from the latest checkpoint in -o")
    a("-a", type=int, default=0, choices=[0, 1], help="1 = overfit a single batch (debugging)")
    a("-z", type=int, default=0, choices=[0, 1],
      help="ZeRO stage under mpiexec: 0 = plain data parallel, 1 = optimizer state sharded across ranks")
    a("--dist-timeout", type=float, default=600.0, metavar="SECONDS",
      help="under mpiexec: abort all ranks when a collective takes longer (a rank died or hangs; 0 = wait forever)")
    a("--device", default="auto", choices=["auto", "cpu", "numpy", "cuda"], help="default auto: cuda if a GPU")
    a("--seed", type=int, default=1337, help="init, shuffling and sampling seed (default 1337)")
    a("--shuffle", action="store_true", help="shuffle shards and samples every epoch")
    a("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    a("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    a("--grad-clip", type=float, default=1.0, help="global-norm gradient clipping (0 = off)")
    a("--beta1", type=float, default=0.9)
    a("--beta2", type=float, default=0.95)
    a("--eps", type=float, default=1e-8)
    a("--tf32", action="store_true", help="GPU: TF32 tensor cores for the matmuls (default exact fp32)")
    a("--profile", type=int, default=0, metavar="N",
      help="profile N steps after a warm-up step: kernel table, module tree, range summary; files in -o/profile")
    a("--nvtx", type=int, default=1, choices=[0, 1], help="NVTX ranges for nsys (default 1; free without a profiler)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from gpt2np.trainer import train
    try:
        train(args)
    except (ValueError, OSError, RuntimeError) as e:      # bad files and inputs: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        from gpt2np.dist import abort_job
        abort_job(1)                                      # under mpiexec: the other ranks must not wait for us
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
