"""Expert parallelism: a mixture-of-experts transformer with its experts spread over the ranks.

Every block's MLP is a MoE layer (top-k router, capacity factor). Rank r keeps experts
r·E/n … (r+1)·E/n − 1 and its share of the batch; each MoE layer sends every token to
the rank of its experts and back with two all_to_all_single; the other weights are
replicated and their gradients all-reduced. The script checks the first step's outputs
and gradients and the weights after --steps Adam steps against one process running the
same model with n routing groups, counts the bytes of the all-to-alls against
E · capacity · d, reports tokens per expert and dropped tokens, and saves the whole model.

    torchrun --standalone --nproc-per-node 2 experts.py --experts 4
"""

import argparse

import torch
import torch.distributed as dist

from lab_utils import dist as labdist
from lab_utils import memory, metrics, models, moe, parallel, profile, text


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (a multiple of N)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is sent to")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="slots per expert = ceil(factor · tokens · k / experts)",
    )
    p.add_argument(
        "--aux-weight",
        type=float,
        default=0.01,
        help="weight of the load-balancing loss added to the language-model loss",
    )
    p.set_defaults(layers=2)
    return p.parse_args(argv)


def build(args: argparse.Namespace, groups: int) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return models.build(
        "moe_char_transformer",
        vocab=text.VOCAB,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        max_len=args.seq_len,
        n_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        groups=groups,
    )


def loss_of(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, aux_weight: float
) -> torch.Tensor:
    return parallel.lm_loss(model(x), y) + aux_weight * moe.aux_loss(model)


def average_gradients(model: torch.nn.Module, n: int) -> None:
    """The global loss is the mean of the ranks' losses: replicated weights sum their
    gradients over the ranks; an expert's already holds every rank's tokens (the
    all-to-all's backward brought them); both are divided by n."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not moe.is_expert_param(name):
            dist.all_reduce(p.grad)
        p.grad /= n


def stats(model: torch.nn.Module) -> dict:
    """Tokens per expert and dropped choices of every MoE layer's last forward."""
    layers = [m.stats for m in model.modules() if isinstance(m, moe.MoE)]
    return {
        "tokens_per_expert": [s["tokens_per_expert"] for s in layers],
        "dropped": [s["dropped"] for s in layers],
        "capacity": layers[0]["capacity"],
    }


def summed(values: list, n: int) -> list:
    """Element-wise sum over the ranks of a nested list of counts."""
    t = torch.tensor(values, dtype=torch.long)
    if n > 1:
        dist.all_reduce(t)
    return t.tolist()


def main() -> None:
    args = parse_args()
    n = labdist.detect().world_size
    parallel.require(
        args.experts % n == 0,
        f"--experts {args.experts} cannot be spread over {n} "
        f"processes: use a multiple of {n} experts, or a process count that divides {args.experts}",
    )
    parallel.require_batch_split(args.batch_size)
    info = labdist.init(group_if_alone=True)
    rank, device = info.rank, info.device
    data = parallel.corpus(args)
    batches = [
        tuple(t.to(device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]
    mine = slice(rank * args.batch_size // n, (rank + 1) * args.batch_size // n)

    model = build(args, groups=1).to(device)
    owned = moe.expert_parallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    first, comm = {}, []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        with moe.count_all_to_all() as seen:
            logits = model(x[mine])
            loss = parallel.lm_loss(logits, y[mine]) + args.aux_weight * moe.aux_loss(model)
            loss.backward()
        average_gradients(model, n)
        if step == 0:
            first = {
                "logits": logits.detach().cpu(),
                "stats": stats(model),
                "grads": {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()},
            }
            comm = list(seen)
        opt.step()
        labdist.print0(f"step {step}: loss {loss.item():.3f}")
    last = stats(model)
    outputs = parallel.gather_on_rank0({f"logits.{rank}": first["logits"]})
    grads = parallel.gather_on_rank0(
        {k: v for k, v in first["grads"].items() if moe.is_expert_param(k) or rank == 0}
    )
    weights = parallel.gather_on_rank0(
        {k: v for k, v in model.state_dict().items() if moe.is_expert_param(k) or rank == 0}
    )
    counts = {
        "first": summed(first["stats"]["tokens_per_expert"], n),
        "first_dropped": summed(first["stats"]["dropped"], n),
        "last": summed(last["tokens_per_expert"], n),
        "last_dropped": summed(last["dropped"], n),
    }
    counts["rank0_state"] = memory.state_bytes(model, opt)  # the last step's gradients included
    if rank == 0:
        report(
            args,
            n,
            owned,
            outputs,
            grads,
            weights,
            counts,
            comm,
            batches,
            first["stats"]["capacity"],
            device,
        )
    labdist.shutdown()


def report(args, n, owned, outputs, grads, weights, counts, comm, batches, cap, device) -> None:
    """Rank 0: one process with n routing groups on the whole batch, compared."""
    ref = build(args, groups=n).to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=args.lr)
    errors = {}
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        logits = ref(x)
        loss = parallel.lm_loss(logits, y) + args.aux_weight * moe.aux_loss(ref)
        loss.backward()
        if step == 0:
            chunks = logits.detach().cpu().chunk(n)
            errors["outputs"] = parallel.relative_error(
                outputs, {f"logits.{r}": c for r, c in enumerate(chunks)}
            )
            errors["gradients"] = parallel.relative_error(
                grads, {k: p.grad.detach().cpu() for k, p in ref.named_parameters()}
            )
        opt.step()
    errors["weights"] = parallel.relative_error(
        weights, {k: v.cpu() for k, v in ref.state_dict().items()}
    )
    tokens = args.batch_size // n * args.seq_len
    formula = moe.all_to_all_bytes(
        tokens, args.d_model, args.experts, args.top_k, args.capacity_factor
    )
    metrics.emit(
        {
            "event": "experts",
            "procs": n,
            "experts": args.experts,
            "top_k": args.top_k,
            "capacity_factor": args.capacity_factor,
            "capacity": cap,
            "layers": args.layers,
            "d_model": args.d_model,
            "tokens_per_rank": tokens,
            "steps": args.steps,
            "aux_weight": args.aux_weight,
            "errors": errors,
            "owned_by_rank0": owned,
            "all_to_all_bytes": comm,
            "formula_bytes": formula,
            **counts,
        }
    )
    print(
        f"{args.experts} experts on {n} ranks (rank 0 holds {owned}): outputs, gradients, weights "
        f"vs one process {errors['outputs']:.1e}, {errors['gradients']:.1e}, {errors['weights']:.1e}; "
        f"{len(comm)} all-to-alls of {sorted(set(comm))} bytes (formula E·C·d·4 = {formula}); "
        f"tokens per expert {counts['first']}, dropped {counts['first_dropped']} (first step)",
        flush=True,
    )
    if args.checkpoint:
        plain = build(args, groups=1)
        plain.load_state_dict(weights)
        models.save(args.checkpoint, plain, steps=args.steps, experts=args.experts, procs=n)
        print(f"saved {args.checkpoint}", flush=True)


if __name__ == "__main__":
    main()
