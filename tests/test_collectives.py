"""The ring all-reduce, the server all-reduce and the parameter server, in simulated
ranks (threads) and in real processes."""

import pytest
import torch
from conftest import REPO

from lab_utils import collectives as C
from lab_utils import launch

RING_CHECK = REPO / "labs" / "lab2_data_parallel" / "scripts" / "ring_check.py"


def inputs(n: int, length: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n * 100 + length)
    if dtype.is_floating_point:
        return [torch.randn(length, generator=g, dtype=dtype) for _ in range(n)]
    return [torch.randint(-1000, 1000, (length,), generator=g, dtype=dtype) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 7, 12, 13, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_ring_all_reduce_sums_any_length_on_every_rank(n, length, dtype):
    xs = inputs(n, length, dtype)
    outputs, _ = C.simulate(C.ring_all_reduce, xs)
    expected = torch.stack(xs).sum(0)
    for out in outputs:
        assert out.dtype == dtype and out.shape == (length,)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "op,reduce",
    [
        ("max", lambda s: s.amax(0)),
        ("min", lambda s: s.amin(0)),
        ("mean", lambda s: s.mean(0)),
        ("prod", lambda s: s.prod(0)),
    ],
)
def test_ring_all_reduce_other_ops(op, reduce):
    xs = inputs(3, 10, torch.float64)
    outputs, _ = C.simulate(C.ring_all_reduce, xs, op=op)
    for out in outputs:
        torch.testing.assert_close(out, reduce(torch.stack(xs)))


def test_ring_keeps_shape_and_leaves_the_input_alone():
    x = torch.arange(12.0).reshape(3, 4)
    outputs, _ = C.simulate(lambda t, comm: (C.ring_all_reduce(t, comm), t), [x, x])
    (result, original), _ = outputs[0], outputs[1]
    assert result.shape == (3, 4)
    torch.testing.assert_close(result, 2 * x)
    torch.testing.assert_close(original, x)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_traffic_is_two_n_minus_one_over_n_of_the_size(n):
    numel = 840  # divisible by 2, 3, 4, 8: exact
    _, traffic = C.simulate(C.ring_all_reduce, inputs(n, numel, torch.float32))
    expected = C.ring_bytes_per_rank(4 * numel, n)
    for t in traffic:
        assert t.bytes_sent == t.bytes_received == expected
        assert t.messages_sent == 2 * (n - 1)


def ring_elements_sent(numel: int, n: int, rank: int) -> int:
    """Rank r sends every chunk but (r+1) in the reduce-scatter, every chunk but (r+2)
    in the all-gather."""
    sizes = C.chunk_sizes(numel, n)
    return 2 * numel - sizes[(rank + 1) % n] - sizes[(rank + 2) % n]


def test_ring_traffic_with_uneven_chunks_is_exact():
    n, numel = 3, 1001
    _, traffic = C.simulate(C.ring_all_reduce, inputs(n, numel, torch.float32))
    assert [t.bytes_sent for t in traffic] == [
        4 * ring_elements_sent(numel, n, r) for r in range(n)
    ]


def test_chunk_sizes_differ_by_at_most_one_and_add_up():
    for numel in range(0, 30):
        for n in range(1, 6):
            sizes = C.chunk_sizes(numel, n)
            assert sum(sizes) == numel and len(sizes) == n
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [2, 3, 4])
def test_server_all_reduce_equals_the_ring_and_loads_the_server(n):
    xs = inputs(n, 64, torch.int64)
    outputs, traffic = C.simulate(C.server_all_reduce, xs)
    for out in outputs:
        assert torch.equal(out, torch.stack(xs).sum(0))
    size = 64 * 8
    assert traffic[0].bytes_received == traffic[0].bytes_sent == C.server_bytes(size, n)
    for t in traffic[1:]:
        assert t.bytes_sent == t.bytes_received == size
    # The busiest link: server 2(N-1)S vs ring 4(N-1)/N S, a factor N/2.
    assert traffic[0].bytes_total / (2 * C.ring_bytes_per_rank(size, n)) == pytest.approx(n / 2)


def test_parameter_server_step_is_sgd_on_the_mean_gradient():
    n, lr = 3, 0.5
    w0 = torch.tensor([1.0, -2.0, 3.0, 0.5])
    grads = inputs(n, 4, torch.float64)
    grads = [g.float() for g in grads]

    def worker(grad, comm):
        ps = C.ParameterServer(w0, comm, lr=lr, server=1)
        first = ps.step(grad)
        return first, ps.step(grad)

    outputs, traffic = C.simulate(worker, grads)
    mean = torch.stack(grads).mean(0)
    for first, second in outputs:
        torch.testing.assert_close(first, w0 - lr * mean)
        torch.testing.assert_close(second, w0 - 2 * lr * mean)
    assert traffic[1].bytes_received == 2 * (n - 1) * 4 * 4  # two pushes from each worker


def test_a_ring_without_isend_deadlocks_and_says_so():
    def blocking_ring(x, comm):
        buf = torch.empty_like(x)
        comm.recv(buf, (comm.rank - 1) % comm.world_size)  # everyone waits, nobody sends
        comm.send(x, (comm.rank + 1) % comm.world_size)
        return x + buf

    with pytest.raises(C.DeadlockError, match="never came"):
        C.simulate(blocking_ring, inputs(3, 6, torch.float32), timeout=0.5)


def test_an_error_in_one_rank_is_reported_with_its_rank():
    def faulty(x, comm):
        if comm.rank == 2:
            raise ValueError("bad chunk index")
        return C.ring_all_reduce(x, comm)

    with pytest.raises(ValueError, match="rank 2 of 3: bad chunk index"):
        C.simulate(faulty, inputs(3, 6, torch.float32), timeout=2)


def test_mismatched_message_sizes_are_explained():
    def mismatched(x, comm):
        if comm.rank == 0:
            comm.send(x, 1)
        else:
            comm.recv(torch.empty(x.numel() + 1), 0)

    with pytest.raises(ValueError, match="must agree on which chunk"):
        C.simulate(mismatched, inputs(2, 5, torch.float32))


def test_unreceived_messages_are_reported():
    with pytest.raises(RuntimeError, match="never received"):
        C.simulate(lambda x, comm: comm.send(x, 1 - comm.rank), inputs(2, 3, torch.float32))


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="op 'avg'"):
        C.simulate(C.ring_all_reduce, inputs(2, 4, torch.float32), op="avg")
    with pytest.raises(TypeError, match="floating-point"):
        C.simulate(C.ring_all_reduce, inputs(2, 4, torch.int64), op="mean")
    with pytest.raises(ValueError, match="ranks 0..1"):
        C.simulate(lambda x, comm: comm.send(x, 5), inputs(2, 4, torch.float32))
    with pytest.raises(RuntimeError, match="needs a process group"):
        C.TorchComm()


def test_ring_time_model():
    assert C.ring_time(1e6, 1, 1e-3, 1e9) == 0.0
    # N=4: 6 messages of latency, 1.5 S of bytes.
    assert C.ring_time(4e6, 4, 1e-4, 1e9) == pytest.approx(6e-4 + 6e-3)


@pytest.mark.slow
@pytest.mark.launcher
def test_ring_matches_dist_all_reduce_in_real_processes():
    """Three processes (an odd ring) over Gloo: groups of 2 and 3, awkward lengths,
    float and int, plus per-rank traffic from the real communicator."""
    result = launch.run(
        RING_CHECK, ["--sizes", "1000", "--repeats", "1"], nprocs=3, timeout=120, echo=False
    ).check()
    checks = result.events("ring_check")
    assert {m["world_size"] for m in checks} == {2, 3}
    assert {m["dtype"] for m in checks} == {"float32", "int64"}
    for m in checks:
        assert m["max_rel_err"] <= (1e-6 if m["dtype"] == "float32" else 0.0), m
    ring, server = result.events("traffic", algo="ring"), result.events("traffic", algo="server")
    assert [m["bytes_sent"] for m in ring] == [4 * ring_elements_sent(1000, 3, r) for r in range(3)]
    assert server[0]["bytes_received"] == C.server_bytes(4000, 3)
