"""Expert parallelism: a mixture-of-experts transformer with its experts spread over the ranks.

Every block's MLP is a MoE layer (top-k router, capacity factor). Rank r keeps experts
r·E/n … (r+1)·E/n − 1 and its share of the batch; each MoE layer sends every token to
the rank of its experts and back with two all_to_all_single; the other weights are
replicated and their gradients all-reduced. The script checks the first step's outputs
and gradients and the weights after --steps Adam steps against one process running the
same model with n routing groups, counts the bytes of the all-to-alls against
E · capacity · d, reports tokens per expert and dropped tokens, and saves the whole model.

    torchrun --standalone --nproc-per-node 2 experts.py --experts 4

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    experts: procs, experts, top_k, capacity_factor, capacity, layers, d_model,
        tokens_per_rank, steps, aux_weight, errors, owned_by_rank0, all_to_all_bytes,
        formula_bytes, first, first_dropped, last, last_dropped (tokens per expert and
        dropped, first and last step), rank0_state
"""

import argparse

import torch
import torch.distributed as dist

from lab_utils import dist as labdist
from lab_utils import gloo_exit, memory, metrics, models, moe, parallel, profile, text


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


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """The global loss is the mean of the ranks' losses: replicated weights sum their
    gradients over the ranks; an expert's already holds every rank's tokens (the
    all-to-all's backward brought them); both are divided by world_size."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not moe.is_expert_param(name):
            dist.all_reduce(p.grad)
        p.grad /= world_size


def stats(model: torch.nn.Module) -> dict:
    """Tokens per expert and dropped choices of every MoE layer's last forward."""
    layers = [m.stats for m in model.modules() if isinstance(m, moe.MoE)]
    return {
        "tokens_per_expert": [s["tokens_per_expert"] for s in layers],
        "dropped": [s["dropped"] for s in layers],
        "capacity": layers[0]["capacity"],
    }


def summed(values: list, device: torch.device) -> list:
    """Element-wise sum over the ranks of a nested list of counts (on the job's device:
    NCCL has no CPU tensors)."""
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t)
    return t.tolist()


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Stop with a message, before any process group, on experts or a batch that
    cannot be spread over the processes."""
    parallel.require(
        args.experts % world_size == 0,
        f"--experts {args.experts} cannot be spread over {world_size} processes: use a "
        f"multiple of {world_size} experts, or a process count that divides {args.experts}",
    )
    parallel.require_batch_split(args.batch_size)


def train(model, opt, batches: list, mine: slice, args: argparse.Namespace) -> tuple[dict, list]:
    """Adam steps on this rank's share of each batch; the first step's logits, routing
    stats and gradients, and the bytes of its all-to-alls."""
    first, comm = {}, []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        with moe.count_all_to_all() as seen:
            logits = model(x[mine])
            loss = parallel.lm_loss(logits, y[mine]) + args.aux_weight * moe.aux_loss(model)
            loss.backward()
        average_gradients(model, labdist.world_size())
        if step == 0:
            first = {
                "logits": logits.detach().cpu(),
                "stats": stats(model),
                "grads": {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()},
            }
            comm = list(seen)
        opt.step()
        labdist.print0(f"step {step}: loss {loss.item():.3f}")
    return first, comm


def gather(model, opt, first: dict, rank: int) -> dict:
    """On rank 0: every rank's first logits, the whole gradients and weights (experts
    from every rank), and the routing counts summed over the ranks."""
    last = stats(model)
    device = next(model.parameters()).device  # the logits were moved to the CPU
    kept = {k for k in model.state_dict() if moe.is_expert_param(k) or rank == 0}
    run = {
        "outputs": parallel.gather_on_rank0({f"logits.{rank}": first["logits"]}),
        "grads": parallel.gather_on_rank0({k: v for k, v in first["grads"].items() if k in kept}),
        "weights": parallel.gather_on_rank0(
            {k: v for k, v in model.state_dict().items() if k in kept}
        ),
        "counts": {
            "first": summed(first["stats"]["tokens_per_expert"], device),
            "first_dropped": summed(first["stats"]["dropped"], device),
            "last": summed(last["tokens_per_expert"], device),
            "last_dropped": summed(last["dropped"], device),
        },
        "capacity": first["stats"]["capacity"],
    }
    run["counts"]["rank0_state"] = memory.state_bytes(model, opt)  # last gradients included
    return run


def main() -> None:
    args = parse_args()
    world_size = labdist.detect().world_size
    check_args(args, world_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    rank, device = info.rank, info.device
    data = parallel.corpus(args)
    batches = [
        tuple(t.to(device) for t in data.batch(args.batch_size, args.seq_len, s, args.seed))
        for s in range(args.steps)
    ]
    mine = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    model = build(args, groups=1).to(device)
    owned = moe.expert_parallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    first, comm = train(model, opt, batches, mine, args)
    run = gather(model, opt, first, rank)
    run.update(comm=comm, owned=owned, world_size=world_size)
    if rank == 0:
        errors = compare_with_one_process(args, run, batches, device)
        report(args, run, errors)
        if args.checkpoint:
            save(args, run["weights"], world_size)
    labdist.shutdown()


def compare_with_one_process(args: argparse.Namespace, run: dict, batches: list, device) -> dict:
    """Rank 0: one process with world_size routing groups on the whole batch; the relative
    errors of the first outputs and gradients and of the final weights."""
    world_size = run["world_size"]
    ref = build(args, groups=world_size).to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=args.lr)
    errors = {}
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        logits = ref(x)
        loss = parallel.lm_loss(logits, y) + args.aux_weight * moe.aux_loss(ref)
        loss.backward()
        if step == 0:
            chunks = logits.detach().cpu().chunk(world_size)
            errors["outputs"] = parallel.relative_error(
                run["outputs"], {f"logits.{r}": c for r, c in enumerate(chunks)}
            )
            errors["gradients"] = parallel.relative_error(
                run["grads"], {k: p.grad.detach().cpu() for k, p in ref.named_parameters()}
            )
        opt.step()
    errors["weights"] = parallel.relative_error(
        run["weights"], {k: v.cpu() for k, v in ref.state_dict().items()}
    )
    return errors


def report(args: argparse.Namespace, run: dict, errors: dict) -> None:
    """Rank 0: errors, all-to-all bytes against E · capacity · d, tokens per expert."""
    world_size, comm, counts, owned = run["world_size"], run["comm"], run["counts"], run["owned"]
    tokens = args.batch_size // world_size * args.seq_len
    formula = moe.all_to_all_bytes(
        tokens, args.d_model, args.experts, args.top_k, args.capacity_factor
    )
    metrics.emit(
        {
            "event": "experts",
            "procs": world_size,
            "experts": args.experts,
            "top_k": args.top_k,
            "capacity_factor": args.capacity_factor,
            "capacity": run["capacity"],
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
        f"{args.experts} experts on {world_size} ranks (rank 0 holds {owned}): outputs, "
        f"gradients, weights vs one process {errors['outputs']:.1e}, "
        f"{errors['gradients']:.1e}, {errors['weights']:.1e}; "
        f"{len(comm)} all-to-alls of {sorted(set(comm))} bytes (formula E·C·d·4 = {formula}); "
        f"tokens per expert {counts['first']}, dropped {counts['first_dropped']} (first step)",
        flush=True,
    )


def save(args: argparse.Namespace, weights: dict, world_size: int) -> None:
    """Rank 0 saves the gathered weights as a one-process model."""
    plain = build(args, groups=1)
    plain.load_state_dict(weights)
    models.save(args.checkpoint, plain, steps=args.steps, experts=args.experts, procs=world_size)
    print(f"saved {args.checkpoint}", flush=True)


if __name__ == "__main__":
    main()
