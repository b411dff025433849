"""Datasets: the real Fashion-MNIST, the CIFAR-10 format via its synthetic stand-in,
verification, search order, downloads and the regression data."""

import functools
import gzip
import hashlib
import http.server
import pickle
import shutil
import threading
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab_utils import data, models
from lab_utils.data import DataError
from lab_utils.loader import TensorLoader

SMALL = {"n_train": 50, "n_test": 10}  # a fast synthetic-cifar10


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Each test gets an empty cache and no $LABS_DATA; parsed data is not shared."""
    monkeypatch.setenv("LABS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LABS_DATA", raising=False)
    data._parse_cached.cache_clear()
    yield
    data._parse_cached.cache_clear()


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> data.Dataset:
    """The real Fashion-MNIST from $LABS_DATA or a system copy (never downloaded)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABS_CACHE", str(tmp_path_factory.mktemp("cache")))
        try:
            return data.load("fashion-mnist", download=False)
        except DataError as e:
            pytest.skip(f"no local copy of Fashion-MNIST: {e}")


@pytest.fixture(scope="module")
def fmnist_dir(fmnist) -> Path:
    return Path(fmnist.source)


@pytest.fixture
def fmnist_copy(fmnist_dir, tmp_path) -> Path:
    """A private copy of the real files, to damage without touching the originals."""
    return Path(shutil.copytree(fmnist_dir, tmp_path / "fashion-mnist-copy"))


# --------------------------------------------------------------------------- real Fashion-MNIST
def test_real_fashion_mnist_shapes_labels_and_statistics(fmnist):
    assert fmnist.name == "fashion-mnist"
    assert fmnist.x_train.shape == (60000, 1, 28, 28) and fmnist.x_test.shape == (10000, 1, 28, 28)
    assert fmnist.x_train.dtype == torch.uint8 and fmnist.y_train.dtype == torch.int64
    assert torch.equal(torch.bincount(fmnist.y_train), torch.full((10,), 6000))
    assert torch.equal(torch.bincount(fmnist.y_test), torch.full((10,), 1000))
    assert len(fmnist.classes) == 10 and fmnist.classes[9] == "Ankle boot"
    mean, std = data.channel_stats(fmnist.x_train)
    assert mean == pytest.approx(fmnist.mean, abs=5e-4)
    assert std == pytest.approx(fmnist.std, abs=5e-4)


def test_corrupted_file_is_detected_by_checksum(fmnist_copy):
    labels = fmnist_copy / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[100] = (raw[100] + 1) % 10  # still a valid label: only the checksum can tell
    labels.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte.gz: checksum mismatch"):
        data.load("fashion-mnist", root=fmnist_copy)


def test_truncated_file_is_detected_by_its_structure(fmnist_copy):
    labels = fmnist_copy / "train-labels-idx1-ubyte.gz"
    raw = gzip.decompress(labels.read_bytes())
    labels.write_bytes(gzip.compress(raw[:-500]))
    with pytest.raises(DataError, match=r"declares shape \(60000,\).*holds 59500.*truncated"):
        data.load("fashion-mnist", root=fmnist_copy)
    # The same check works without any checksum.
    with pytest.raises(DataError, match="truncated"):
        data.read_idx(labels)


def test_cut_gzip_file_is_reported(fmnist_copy):
    images = fmnist_copy / "t10k-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:1000])
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte.gz: cannot decompress.*truncated"):
        data.load("fashion-mnist", root=fmnist_copy)


def test_read_idx_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "x.idx"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(DataError, match="not an IDX file"):
        data.read_idx(path)


# --------------------------------------------------------------------------- search order
def test_search_order_root_then_labs_data_then_cache(tmp_path, monkeypatch):
    root = data.write_synthetic_cifar10(tmp_path / "root", **SMALL, seed=1)
    env = data.write_synthetic_cifar10(tmp_path / "env" / "synthetic-cifar10", **SMALL, seed=2)
    cache = data.write_synthetic_cifar10(tmp_path / "cache" / "synthetic-cifar10", **SMALL, seed=3)
    monkeypatch.setenv("LABS_DATA", str(tmp_path / "env"))
    found = {}
    found["root"] = data.load("synthetic-cifar10", root=root)
    found["env"] = data.load("synthetic-cifar10")
    monkeypatch.delenv("LABS_DATA")
    found["cache"] = data.load("synthetic-cifar10")
    for key, folder in (("root", root), ("env", env), ("cache", cache)):
        assert found[key].source == str(folder.resolve())
    # Three different seeds, three different sets: the content came from those folders.
    assert not torch.equal(found["root"].x_train, found["env"].x_train)
    assert not torch.equal(found["env"].x_train, found["cache"].x_train)


def test_a_corrupted_copy_is_reported_not_skipped(tmp_path, monkeypatch):
    root = data.write_synthetic_cifar10(tmp_path / "root", **SMALL)
    data.write_synthetic_cifar10(tmp_path / "cache" / "synthetic-cifar10", **SMALL)
    batch = root / "data_batch_3"
    raw = bytearray(batch.read_bytes())
    raw[-200] ^= 0xFF  # one pixel of the image data
    batch.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="data_batch_3: checksum mismatch: md5"):
        data.load("synthetic-cifar10", root=root)


def test_offline_without_a_copy_says_where_it_looked_and_what_to_put_there(tmp_path, monkeypatch):
    monkeypatch.setenv("LABS_DATA", str(tmp_path / "datasets"))
    monkeypatch.setattr(data, "SYSTEM_DIRS", (tmp_path / "system",))
    with pytest.raises(DataError) as info:
        data.load("cifar10", root=tmp_path / "mine", download=False)
    message = str(info.value)
    for place in (
        tmp_path / "mine",
        tmp_path / "datasets" / "cifar-10-batches-py",
        tmp_path / "cache" / "cifar10" / "cifar-10-batches-py",
        tmp_path / "system" / "cifar10" / "cifar-10-batches-py",
    ):
        assert str(place) in message
    assert "data_batch_1" in message and "batches.meta" in message
    assert "download=False" in message and "LABS_DATA" in message


def test_a_failed_download_keeps_the_search_report(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    monkeypatch.setattr(data, "SYSTEM_DIRS", ())
    with pytest.raises(DataError, match=r"(?s)the download failed.*no route to host.*Looked in"):
        data.load("fashion-mnist", root=tmp_path / "nothing-here")
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="unknown dataset 'mnist'.*fashion-mnist"):
        data.load("mnist")


# --------------------------------------------------------------------------- CIFAR-10 format
def test_synthetic_cifar10_is_generated_into_the_cache_in_the_real_format(tmp_path):
    ds = data.load("synthetic-cifar10")
    folder = tmp_path / "cache" / "synthetic-cifar10"
    assert ds.name == "synthetic-cifar10" and ds.source == str(folder.resolve())
    assert ds.x_train.shape == (5000, 3, 32, 32) and ds.x_test.shape == (1000, 3, 32, 32)
    assert ds.x_train.dtype == torch.uint8 and ds.y_train.dtype == torch.int64
    assert torch.equal(torch.bincount(ds.y_train), torch.full((10,), 500))
    assert len(ds.classes) == 10 and all("pattern" in c for c in ds.classes)
    assert ds.mean == pytest.approx(data.channel_stats(ds.x_train)[0])
    assert {p.name for p in folder.iterdir()} == set(data.CIFAR10_MD5) | {"checksums.md5"}
    with open(folder / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")  # what the official CIFAR page does
    assert set(batch) == {b"data", b"labels", b"batch_label", b"filenames"}
    assert batch[b"data"].shape == (1000, 3072) and batch[b"data"].dtype == np.uint8
    # Row-major RGB planes: the first 1024 values are the red plane of image 0.
    assert torch.equal(ds.x_train[0, 0].reshape(-1), torch.from_numpy(batch[b"data"][0, :1024]))
    assert ds.y_train[:1000].tolist() == batch[b"labels"]


def test_synthetic_cifar10_is_deterministic_per_seed(tmp_path):
    a = data.write_synthetic_cifar10(tmp_path / "a", **SMALL, seed=5)
    b = data.write_synthetic_cifar10(tmp_path / "b", **SMALL, seed=5)
    c = data.write_synthetic_cifar10(tmp_path / "c", **SMALL, seed=6)
    assert (a / "checksums.md5").read_text() == (b / "checksums.md5").read_text()
    assert (a / "checksums.md5").read_text() != (c / "checksums.md5").read_text()


@pytest.fixture
def one_thread():
    """Training on a shared 2-core machine: two intra-op threads can be many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_synthetic_cifar10_is_learnable_in_one_short_epoch(one_thread):
    ds = data.load("synthetic-cifar10")
    torch.manual_seed(0)
    model = models.build("resnet_cifar", width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for xb, yb in TensorLoader.from_dataset(ds.subset(n_train=2000), "train", 32):
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        xb, yb = next(iter(TensorLoader.from_dataset(ds.subset(n_test=500), "test", 500)))
        accuracy = (model(xb).argmax(1) == yb).float().mean().item()
    assert accuracy > 0.5, accuracy  # chance is 0.1


def test_truncated_and_foreign_pickles_are_refused(tmp_path):
    folder = data.write_synthetic_cifar10(tmp_path / "syn", **SMALL)
    batch = folder / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:3000])
    with pytest.raises(
        DataError, match="data_batch_2: cannot read it as a CIFAR-10 pickle.*truncated"
    ):
        data.load("synthetic-cifar10", root=folder)

    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil_batch"
    evil.write_bytes(pickle.dumps({"data": _Payload(marker)}))
    with pytest.raises(DataError, match="refusing to load pathlib"):
        data.read_cifar_batch(evil)
    assert not marker.exists()


class _Payload:
    """Unpickling this object creates a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_wrong_shapes_in_a_batch_are_reported(tmp_path):
    folder = data.write_synthetic_cifar10(tmp_path / "syn", **SMALL)
    bad = {b"data": np.zeros((10, 100), np.uint8), b"labels": [0] * 10}
    raw = pickle.dumps(bad, protocol=4)
    (folder / "test_batch").write_bytes(raw)
    manifest = folder / "checksums.md5"
    lines = [ln for ln in manifest.read_text().splitlines() if not ln.endswith("test_batch")]
    digest = hashlib.md5(raw).hexdigest()
    manifest.write_text("\n".join([*lines, f"{digest}  test_batch"]) + "\n")
    with pytest.raises(DataError, match=r"test_batch: 'data' must be a uint8 array \(N, 3072\)"):
        data.load("synthetic-cifar10", root=folder)


def test_parsed_tensors_are_cached_on_disk_and_invalidated_by_edits(tmp_path, monkeypatch):
    folder = data.write_synthetic_cifar10(tmp_path / "syn", **SMALL)
    first = data.load("synthetic-cifar10", root=folder)
    assert data.load("synthetic-cifar10", root=folder).x_train is first.x_train  # in-process
    assert len(list((tmp_path / "cache" / "tensors").glob("synthetic-cifar10-*.pt"))) == 1
    data._parse_cached.cache_clear()

    def no_parsing(folder):
        raise AssertionError("parsed again")

    monkeypatch.setattr(data, "_read_synthetic_cifar10", no_parsing)
    again = data.load("synthetic-cifar10", root=folder)
    assert torch.equal(again.x_train, first.x_train) and again.mean == first.mean
    (folder / "batches.meta").touch()  # a changed file must not be served from the cache
    with pytest.raises(AssertionError, match="parsed again"):
        data.load("synthetic-cifar10", root=folder)


# --------------------------------------------------------------------------- downloads
@pytest.fixture
def http_folder(tmp_path):
    """Serve ``tmp_path/www`` on 127.0.0.1; yields (folder, base URL)."""
    www = tmp_path / "www"
    www.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(www))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_cifar10_download_verifies_and_unpacks(http_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    www, url = http_folder
    source = data.write_synthetic_cifar10(tmp_path / "src", **SMALL)
    md5 = data.make_cifar10_archive(source, www / "cifar-10-python.tar.gz")
    dest = tmp_path / "dl"
    folder = data.download_cifar10(dest, url=url + "cifar-10-python.tar.gz", md5=md5)
    assert folder == dest / "cifar-10-batches-py"
    for f in source.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == ["cifar-10-batches-py"]  # archive removed
    ds = data.load("synthetic-cifar10", root=folder)  # the real parser and verifier
    assert ds.x_train.shape == (50, 3, 32, 32)

    bad = tmp_path / "dl-bad"
    with pytest.raises(DataError, match="md5 is .*expected 0000.*nothing was kept"):
        data.download_cifar10(bad, url=url + "cifar-10-python.tar.gz", md5="0" * 32)
    assert list(bad.iterdir()) == []


def test_fashion_mnist_download_verifies_each_file(http_folder, fmnist_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    www, url = http_folder
    for name in data.FASHION_MNIST_SHA256:
        shutil.copy(fmnist_dir / name, www / name)
    raw = bytearray(gzip.decompress((www / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[-1] = (raw[-1] + 1) % 10
    (www / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    dest = tmp_path / "fm"
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz.*checksum mismatch"):
        data.download_fashion_mnist(dest, base_url=url)
    # Verified files were kept; the bad one left nothing behind, not even a partial file.
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        n for n in data.FASHION_MNIST_SHA256 if not n.startswith("t10k-labels")
    )


# --------------------------------------------------------------------------- Dataset.subset
def test_subset_is_random_reproducible_and_keeps_pairs():
    n = 100
    x = torch.arange(n, dtype=torch.uint8).reshape(n, 1, 1, 1)
    ds = data.Dataset(
        "toy", x, torch.arange(n), x[:20], torch.arange(20), ("a",), (0.5,), (0.5,), "-"
    )
    a, b, c = ds.subset(10, 5, seed=1), ds.subset(10, 5, seed=1), ds.subset(10, 5, seed=2)
    assert len(a.x_train) == 10 and len(a.x_test) == 5
    assert torch.equal(a.y_train, b.y_train) and not torch.equal(a.y_train, c.y_train)
    assert torch.equal(a.x_train.reshape(-1).long(), a.y_train)  # images stay with their labels
    assert a.y_train.tolist() != list(range(10))
    assert len(ds.subset(n_train=1000).x_train) == n  # more than there are: all of them
    with pytest.raises(ValueError, match="n_test must be >= 0"):
        ds.subset(n_test=-1)


# --------------------------------------------------------------------------- regression
def test_synthetic_regression_has_the_stated_truth():
    X, y, w, b = data.synthetic_regression(n=2000, d=3, noise=0.1, seed=0)
    assert X.shape == (2000, 3) and y.shape == (2000,) and w.shape == (3,)
    assert np.std(y - X @ w - b) == pytest.approx(0.1, rel=0.1)
    again = data.synthetic_regression(n=2000, d=3, noise=0.1, seed=0)
    assert np.array_equal(again[0], X) and np.array_equal(again[1], y)
    _, _, _, no_bias = data.synthetic_regression(n=10, bias=False)
    assert no_bias == 0.0


def test_synthetic_regression_condition_number():
    X, _, _, _ = data.synthetic_regression(n=500, d=4, condition_number=100.0, seed=1)
    eigenvalues = np.linalg.eigvalsh(X.T @ X / len(X))
    assert eigenvalues.max() / eigenvalues.min() == pytest.approx(100.0, rel=1e-6)
    assert np.abs(X.mean(axis=0)).max() < 1e-9
    with pytest.raises(ValueError, match="d >= 2"):
        data.synthetic_regression(d=1, condition_number=10.0)
    with pytest.raises(ValueError, match="noise"):
        data.synthetic_regression(noise=-1)
