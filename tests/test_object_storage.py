"""Artifacts on object storage: a real S3-protocol server (moto's standalone server, in its own
process on 127.0.0.1) reached through s3fs. ``sluice shard --out s3://`` writes there; the
loader reads back through a verified, size-limited local cache; a corrupt object never reaches
a batch, and a corrupt or cut-short download is retried."""
from __future__ import annotations

import http.client
import http.server
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import ROOT
from s3_server import start_s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from sluice.errors import ArtifactError  # noqa: E402
from sluice.stages.load import Loader, SamplerConfig  # noqa: E402
from sluice.storage.artifact import open_artifact  # noqa: E402

BUCKET = "sluice-test"
SHARD = ["--set", "ingest.limit=600", "--set", "ingest.seed=4", "--set", "shard.shard_samples=128", "--set", "shard.workers=2"]


class _Flaky(http.server.BaseHTTPRequestHandler):
    """A pass-through proxy to the S3 server that spoils the first GET of chosen objects:
    ``spoil[key] = "corrupt"`` flips bytes of the body, ``"truncate"`` cuts it short."""
    protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue"
    upstream: int = 0
    endpoint = ""
    spoil: dict[str, str] = {}
    spoiled: list[str] = []

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
        conn.request(self.command, self.path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        conn.close()  # every path: an upstream connection left open holds moto's server on it
        key = self.path.split("?")[0]
        how = next((v for k, v in self.spoil.items() if key.endswith(k)), None) if self.command == "GET" else None
        if how is not None and r.status in (200, 206):
            self.spoil = {k: v for k, v in self.spoil.items() if not key.endswith(k)}
            type(self).spoil = self.spoil
            self.spoiled.append(f"{how} {key}")
            if how == "corrupt":
                data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        else:
            self.send_header("Content-Length", r.getheader("Content-Length", "0"))
        self.end_headers()
        if how == "truncate":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The S3 server, reached by s3fs through the environment (as a user's own endpoint would
    be), and a proxy in front of it for the spoiled-download test."""
    server, port = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    proxy = None
    old = dict(os.environ)
    try:
        _Flaky.upstream = port
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{port}"
        _Flaky.endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
        import s3fs
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        fs.mkdir(BUCKET)
        yield fs
    finally:
        os.environ.clear()
        os.environ.update(old)
        if proxy is not None:
            proxy.shutdown()
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def remote(s3, fmnist_artifact):
    """``sluice shard --out s3://...``, the same source and config as the local fixture."""
    url = f"s3://{BUCKET}/fmnist"
    r = subprocess.run([sys.executable, "-m", "sluice.flows.cli", "shard", "fashion-mnist", "--out", url,
                        "--quiet", *SHARD], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return url


def _epoch(loader):
    xs, idx = [], []
    for x, _, i in loader:
        xs.append(x)
        idx.append(i)
    return torch.cat(xs), torch.cat(idx)


@pytest.mark.slow
def test_shard_to_s3_then_load_through_the_cache(s3, remote, fmnist_artifact, tmp_path):
    art = open_artifact(remote, cache_dir=tmp_path / "cache")
    assert art.fingerprint == fmnist_artifact.manifest.fingerprint      # the same bytes, uploaded
    assert s3.exists(f"{BUCKET}/fmnist/LATEST")
    for backend in ("webdataset", "memory", "ffcv"):
        cfg = dict(split="train", batch_size=64, backend=backend, workers=2, sampler=SamplerConfig(kind="shuffle", seed=1))
        x, i = _epoch(Loader(remote, cache={"dir": str(tmp_path / "cache")}, **cfg))
        x0, i0 = _epoch(Loader(fmnist_artifact.root, **cfg))
        assert torch.equal(i, i0) and torch.equal(x, x0), backend
    cached = sorted(p.relative_to(art.cache.dir).as_posix() for p in art.cache.dir.rglob("*")
                    if p.is_file() and ".locks" not in p.parts)
    assert "train/shard-000000.tar" in cached and "train/data.beton" in cached


@pytest.mark.slow
def test_cache_limit_evicts_and_prefetches_in_the_order_of_need(remote, fmnist_artifact, tmp_path):
    shards = fmnist_artifact.manifest.splits["train"].shards
    limit = 3 * max(sh.tar.bytes for sh in shards) + 4096
    # workers=0: every fetch and eviction happens in this process, where the stats are counted
    cfg = dict(split="train", batch_size=32, backend="webdataset", workers=0,
               sampler=SamplerConfig(kind="shard_block", window=1, seed=2))
    L = Loader(remote, cache={"dir": str(tmp_path / "c"), "max_bytes": limit, "prefetch_shards": 1}, **cfg)
    x, i = _epoch(L)
    x0, i0 = _epoch(Loader(fmnist_artifact.root, **cfg))
    assert torch.equal(i, i0) and torch.equal(x, x0)
    st = L.artifact.cache.stats
    assert st["evicted"] >= 1 and L.artifact.cache.cached_bytes() <= limit
    assert "cache" in L.profile_report()
    # the plan done, the prefetch thread waits instead of re-walking it (it once spun forever,
    # re-fetching what it had, holding the file locks the workers needed)
    seen = dict(st)
    time.sleep(1.5)
    assert L.artifact.cache.stats == seen


@pytest.mark.slow
def test_a_corrupt_object_never_reaches_a_batch(s3, remote, fmnist_artifact, tmp_path):
    art = open_artifact(remote)
    victim = art.manifest.splits["train"].shards[2]
    key = f"{art.root[len('s3://'):]}/{victim.tar.path}"
    good = s3.cat_file(key)
    s3.pipe_file(key, good[:600] + bytes(b ^ 0x55 for b in good[600:700]) + good[700:])   # same size
    try:
        L = Loader(remote, split="train", batch_size=32, backend="webdataset", workers=1,
                   sampler=SamplerConfig(kind="sequential"), cache={"dir": str(tmp_path / "c"), "retries": 1})
        seen = []
        with pytest.raises(ArtifactError, match=r"shard-000002\.tar.*corrupted.*2 attempts"):
            for _, _, idx in L:
                seen += idx.tolist()
        lo = victim.first_index
        assert seen and max(seen) < lo                    # batches stopped before the bad shard
        assert not (L.artifact.cache.dir / victim.tar.path).exists()   # nothing unverified cached
    finally:
        s3.pipe_file(key, good)


@pytest.mark.slow
def test_a_spoiled_download_is_retried(remote, fmnist_artifact, tmp_path, monkeypatch):
    import s3fs
    _Flaky.spoiled.clear()
    _Flaky.spoil = {"train/shard-000001.tar": "corrupt", "train/shard-000003.tar": "truncate"}
    cfg = dict(split="train", batch_size=64, backend="webdataset", workers=0, sampler=SamplerConfig(kind="shuffle"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", _Flaky.endpoint)   # through the spoiling proxy
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        L = Loader(remote, cache={"dir": str(tmp_path / "c")}, **cfg)
        x, i = _epoch(L)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    x0, i0 = _epoch(Loader(fmnist_artifact.root, **cfg))
    assert torch.equal(i, i0) and torch.equal(x, x0)
    assert len(_Flaky.spoiled) == 2, _Flaky.spoiled
    # the corrupt body passed every HTTP check: only the sha256 caught it, and we fetched again
    # (a body cut short is an HTTP error that s3fs may retry itself before we see it)
    assert L.artifact.cache.stats["retried"] >= 1
