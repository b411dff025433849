"""A mixture-of-experts feed-forward layer, on one process or with its experts spread
over ranks (expert parallelism).

    layer = MoE(d_model, n_experts, hidden, top_k=2, capacity_factor=1.25)
    y = layer(x)                       # one process: every expert here
    expert_parallel(model, group)      # this rank keeps only its experts
    y = layer(x)                       # dispatch and combine with two all_to_all_single

The router picks each token's ``top_k`` experts (:func:`top_k_route`, which is also the
reference of Lab 4.8's exercise); every expert takes at most
``capacity = ceil(capacity_factor · tokens · top_k / n_experts)`` of a group's tokens,
and a choice beyond it is dropped (its token passes through the block's residual
only). Tokens are routed in groups (GShard): on one process ``groups`` splits the
batch into that many equal groups; with experts on n ranks each rank's tokens are one
group, so the split layer equals the one-process layer with ``groups = n``.
Dispatch lays each group's tokens into a buffer of ``(n_experts, capacity, d)`` slots;
``all_to_all_single`` sends each expert's slots to the rank that holds it and a second
one brings the results back: ``n_experts · capacity · d`` values each way per layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lab_utils import models

Router = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, ...]]


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``tokens``: ceil(factor · tokens · k / E)."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def top_k_route(logits: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, ...]:
    """Top-k routing with a capacity per expert, for ``logits`` of shape ``(N, E)``.

    Returns ``(experts, gates, slots, kept)``, each ``(N, k)``: the chosen experts in
    order of preference, their softmax probabilities renormalised over the k choices,
    each choice's slot in its expert's buffer (how many choices of that expert came
    before it: every token's first choice, in token order, then every second choice, …),
    and whether the slot is below ``capacity`` (a choice beyond it is dropped).
    """
    probs = torch.softmax(logits, dim=-1)
    top, experts = probs.topk(k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True)
    n, n_experts = logits.shape
    onehot = nn.functional.one_hot(experts.T.reshape(-1), n_experts)  # (k·N, E), choice-major
    slots = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view(k, n).T
    return experts, gates, slots, slots < capacity


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E · Σ_e f_e · P_e``: ``f_e`` the share of the
    top-k choices that went to expert e, ``P_e`` its mean router probability. It is 1 when
    both are uniform and grows as the router favours a few experts; only ``P_e`` carries a
    gradient, which pushes probability away from the experts that get the most tokens."""
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype) / experts.numel()
    return n_experts * (f * probs.mean(0)).sum()


class Expert(nn.Module):
    """One expert: the transformer's MLP, ``fc2(gelu(fc1(x)))``."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits along dim 0; its gradient is the same
    exchange backwards (the chunk a rank sent comes back as the chunk's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class MoE(nn.Module):
    """Top-k routed experts with a capacity factor (see the module's docstring).

    After each forward ``self.stats`` holds this rank's ``tokens_per_expert`` (choices
    before the capacity cut), ``dropped`` (choices cut), ``capacity`` and ``aux`` (the
    load-balancing loss, averaged over the groups, with its gradient)."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        hidden: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.groups = groups
        self.router = nn.Linear(d_model, n_experts, bias=False)
        # keyed by the global expert index, so a rank holding some experts keeps their names
        self.experts = nn.ModuleDict({str(e): Expert(d_model, hidden) for e in range(n_experts)})
        self.group: dist.ProcessGroup | None = None  # set by expert_parallel
        self.route: Router = top_k_route
        self.stats: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        groups = 1 if self.group is not None else self.groups
        if tokens.shape[0] % groups:
            raise ValueError(f"{tokens.shape[0]} tokens do not split into {groups} routing groups")
        per_group = tokens.view(groups, -1, shape[-1])
        cap = capacity(per_group.shape[1], self.n_experts, self.top_k, self.capacity_factor)
        routed = [self._dispatch(g, cap) for g in per_group]
        buffers = torch.stack([r[0] for r in routed])  # (groups, E, cap, d)
        done = self._experts_on(buffers)
        out = torch.stack(
            [self._combine(done[i], *routed[i][1:4], per_group.shape[1]) for i in range(groups)]
        )
        self.stats = {
            "tokens_per_expert": sum(r[4] for r in routed).tolist(),
            "dropped": int(sum(r[5] for r in routed)),
            "capacity": cap,
            "aux": torch.stack([r[6] for r in routed]).mean(),
        }
        return out.reshape(shape)

    def _dispatch(self, x: torch.Tensor, cap: int) -> tuple:
        """One group's tokens laid into ``(E, cap, d)`` slots, and how to put them back."""
        logits = self.router(x)
        experts, gates, slots, kept = self.route(logits, self.top_k, cap)
        buf = x.new_zeros(self.n_experts * cap, x.shape[-1])
        token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(experts)
        where = (experts * cap + slots)[kept]
        buf = buf.index_copy(0, where, x[token[kept]])
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        aux = load_balancing_loss(torch.softmax(logits, -1), experts, self.n_experts)
        return (
            buf.view(self.n_experts, cap, -1),
            where,
            gates[kept],
            token[kept],
            counts,
            int((~kept).sum()),
            aux,
        )

    def _experts_on(self, buffers: torch.Tensor) -> torch.Tensor:
        """Each expert applied to its slots: here, or on the rank that holds it."""
        if self.group is None:
            return torch.stack(
                [self.experts[str(e)](buffers[:, e]) for e in range(self.n_experts)], 1
            )
        n = dist.get_world_size(self.group)
        local = self.n_experts // n
        g, e, cap, d = buffers.shape  # g == 1: this rank's tokens
        sent = _AllToAll.apply(buffers.reshape(n, local, cap, d), self.group)  # (source rank, …)
        mine = sorted(int(k) for k in self.experts)
        done = torch.stack([self.experts[str(k)](sent[:, i]) for i, k in enumerate(mine)], 1)
        back = _AllToAll.apply(done, self.group)  # (owner rank, local expert, cap, d)
        return back.reshape(g, e, cap, d)

    @staticmethod
    def _combine(
        done: torch.Tensor,
        where: torch.Tensor,
        gates: torch.Tensor,
        token: torch.Tensor,
        n_tokens: int,
    ) -> torch.Tensor:
        """Σ over a token's kept choices of gate × its expert's output (0 if all dropped)."""
        flat = done.reshape(-1, done.shape[-1])
        out = flat.new_zeros(n_tokens, flat.shape[-1])
        return out.index_add(0, token, flat[where] * gates.unsqueeze(1))


def expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> list[int]:
    """Keep on this rank only its share of every MoE layer's experts (rank r of n holds
    experts r·E/n … (r+1)·E/n − 1) and route through ``group``. Returns those indices."""
    group = group or dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    mine: list[int] = []
    for layer in model.modules():
        if isinstance(layer, MoE):
            if layer.n_experts % n:
                raise ValueError(f"{layer.n_experts} experts do not split over {n} ranks")
            local = layer.n_experts // n
            mine = list(range(rank * local, (rank + 1) * local))
            for e in range(layer.n_experts):
                if e not in mine:
                    del layer.experts[str(e)]
            layer.group = group
    return mine


def is_expert_param(name: str) -> bool:
    """Whether a parameter belongs to an expert (held by one rank) rather than replicated."""
    return ".experts." in f".{name}"


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's load-balancing loss of the last forward."""
    return sum(m.stats["aux"] for m in model.modules() if isinstance(m, MoE))


@contextlib.contextmanager
def count_all_to_all() -> Iterator[list[int]]:
    """Bytes of each ``all_to_all_single`` call (its full input tensor) inside the block."""
    seen: list[int] = []
    original = dist.all_to_all_single

    def counted(output: torch.Tensor, input: torch.Tensor, *args, **kwargs):
        seen.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield seen
    finally:
        dist.all_to_all_single = original


def all_to_all_bytes(
    tokens: int,
    d_model: int,
    n_experts: int,
    top_k: int,
    capacity_factor: float,
    element_size: int = 4,
) -> int:
    """Bytes of one all-to-all of one layer: E · capacity · d values of a group of ``tokens``."""
    return n_experts * capacity(tokens, n_experts, top_k, capacity_factor) * d_model * element_size


class MoEBlock(nn.Module):
    """A pre-norm transformer block whose MLP is a :class:`MoE` layer."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_experts: int,
        top_k: int,
        capacity_factor: float,
        groups: int,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = models.SelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.moe = MoE(d_model, n_experts, 4 * d_model, top_k, capacity_factor, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


@models.register("moe_char_transformer")
class MoECharTransformer(nn.Module):
    """``char_transformer`` with every block's MLP replaced by a mixture of experts."""

    def __init__(
        self,
        vocab: int = 96,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        max_len: int = 64,
        n_experts: int = 4,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            models.TokenEmbedding(vocab, d_model, max_len),
            *[
                MoEBlock(d_model, n_heads, n_experts, top_k, capacity_factor, groups)
                for _ in range(n_layers)
            ],
            models.LMHead(d_model, vocab),
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layers(idx)


def train_layer(
    layer: MoE,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    steps: int,
    aux_weight: float,
    lr: float = 1e-2,
) -> list[dict]:
    """Fit ``layer(x)`` to ``target`` (mean squared error + ``aux_weight`` × the
    load-balancing loss) with Adam; the routing statistics of every step."""
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(layer(x), target) + aux_weight * layer.stats["aux"]
        loss.backward()
        opt.step()
        history.append(
            {k: v for k, v in layer.stats.items() if k != "aux"}
            | {"aux": float(layer.stats["aux"].detach())}
        )
    return history
