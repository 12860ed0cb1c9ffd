"""The fake Hub is faithful: huggingface_hub's own public functions work against it as against the Hub."""

import hashlib
import json
import os
import time

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import HfApi, get_cached_repo_tree, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from fake_hub import SD15_FILES, SDXL_BASE_FILES, FakeHub, fake_repo, hub_at, set_offline

REPO = "stabilityai/stable-diffusion-xl-base-1.0"
UNET_CONFIG = json.dumps({"_class_name": "UNet2DConditionModel", "sample_size": 128}).encode()
PATTERNS = ["model_index.json", "*/config.json", "unet/*.fp16.safetensors"]
EXPECTED = sorted(
    ["model_index.json", "unet/diffusion_pytorch_model.fp16.safetensors"]
    + [p for p in SDXL_BASE_FILES if p.endswith("/config.json")]
)


@pytest.fixture
def fake():
    with FakeHub({REPO: fake_repo(SDXL_BASE_FILES, {"unet/config.json": UNET_CONFIG})}) as hub:
        yield hub
    assert not hub.errors, hub.errors


def test_fake_repo_fills_every_listed_file():
    repo = fake_repo(SD15_FILES, {"unet/config.json": b"{}"})
    assert sorted(repo) == sorted(SD15_FILES)
    assert repo["unet/config.json"] == b"{}"
    assert len(set(repo.values())) == len(repo)  # placeholders differ: no two files share a blob
    assert json.loads(repo["model_index.json"]) == {"_fake_hub_placeholder": "model_index.json"}
    for path in (
        "unet/diffusion_pytorch_model.non_ema.safetensors",
        "v1-5-pruned.ckpt",
        "feature_extractor/preprocessor_config.json",
        "safety_checker/model.fp16.safetensors",
    ):
        assert path in repo


def test_snapshot_download_then_offline(fake, tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    commit = fake.commit(REPO)
    with hub_at(fake, cache, monkeypatch):
        # (1) Only the matching files, into a real cache laid out as huggingface_hub lays it out.
        folder = snapshot_download(REPO, allow_patterns=PATTERNS)
        storage = cache / "models--stabilityai--stable-diffusion-xl-base-1.0"
        assert folder == str(storage / "snapshots" / commit)
        assert (storage / "refs" / "main").read_text() == commit
        got = sorted(str(p.relative_to(folder)) for p in (storage / "snapshots" / commit).rglob("*") if not p.is_dir())
        assert got == EXPECTED
        for path in EXPECTED:
            link = storage / "snapshots" / commit / path
            assert link.is_symlink()
            assert link.resolve() == storage / "blobs" / fake.etag(REPO, path)
        # LFS blobs are named by their sha256, git blobs by their git sha1.
        lfs = storage / "snapshots" / commit / "unet/diffusion_pytorch_model.fp16.safetensors"
        assert lfs.resolve().name == hashlib.sha256(lfs.read_bytes()).hexdigest()
        config = storage / "snapshots" / commit / "unet/config.json"
        assert config.read_bytes() == UNET_CONFIG
        assert config.resolve().name == hashlib.sha1(b"blob %d\0" % len(UNET_CONFIG) + UNET_CONFIG).hexdigest()
        # The per-commit tree listing holds the whole repo, not just what was fetched.
        tree = json.loads((storage / "trees" / f"{commit}.json").read_text())
        assert sorted(tree["files"]) == sorted(SDXL_BASE_FILES)
        assert tree["files"]["unet/diffusion_pytorch_model.fp16.safetensors"]["lfs_sha256"] == lfs.resolve().name
        assert sorted(f.path for f in get_cached_repo_tree(REPO)) == sorted(SDXL_BASE_FILES)
        # (5) The fake saw exactly those downloads, each once; HEAD calls don't count.
        assert sorted(fake.downloaded(REPO)) == EXPECTED

        # Again, online: everything is cached, nothing is downloaded a second time.
        assert snapshot_download(REPO, allow_patterns=PATTERNS) == folder
        assert sorted(fake.downloaded(REPO)) == EXPECTED

    # (2) Offline: the listing shows files never fetched, so the whole snapshot is incomplete, while
    # the same patterns are satisfied (the behaviour the project's bug report describes).
    with hub_at(fake, cache, monkeypatch, offline=True):
        assert huggingface_hub.constants.HF_HUB_OFFLINE
        n_requests = len(fake.requests)
        with pytest.raises(IncompleteSnapshotError):
            snapshot_download(REPO, local_files_only=True)
        with pytest.raises(IncompleteSnapshotError):
            snapshot_download(REPO)  # HF_HUB_OFFLINE alone: the same
        assert snapshot_download(REPO, allow_patterns=PATTERNS, local_files_only=True) == folder
        assert snapshot_download(REPO, allow_patterns=PATTERNS) == folder
        assert hf_hub_download(REPO, "unet/config.json") == str(storage / "snapshots" / commit / "unet/config.json")
        with pytest.raises(LocalEntryNotFoundError):
            hf_hub_download(REPO, "vae/diffusion_pytorch_model.safetensors")
        assert len(fake.requests) == n_requests  # offline means no request at all

    set_offline(monkeypatch, False)  # and the switch turns back
    assert not huggingface_hub.constants.HF_HUB_OFFLINE


def test_api_calls(fake, tmp_path, monkeypatch):
    with hub_at(fake, tmp_path / "hf-cache", monkeypatch) as endpoint:
        assert endpoint == fake.url and huggingface_hub.constants.ENDPOINT == fake.url
        commit = fake.commit(REPO)
        info = HfApi().repo_info(REPO)
        assert info.id == REPO and info.sha == commit
        assert sorted(s.rfilename for s in info.siblings) == sorted(SDXL_BASE_FILES)
        assert huggingface_hub.model_info(REPO, timeout=5).sha == commit  # the module-level HfApi too
        info = HfApi().model_info(REPO, revision=commit, files_metadata=True, timeout=5)
        sizes = {s.rfilename: s for s in info.siblings}
        assert sizes["unet/config.json"].size == len(UNET_CONFIG) and sizes["unet/config.json"].lfs is None
        assert sizes["unet/diffusion_pytorch_model.safetensors"].lfs.sha256 == fake.etag(
            REPO, "unet/diffusion_pytorch_model.safetensors"
        )
        assert sorted(huggingface_hub.list_repo_files(REPO)) == sorted(SDXL_BASE_FILES)
        top = list(HfApi().list_repo_tree(REPO))
        assert {e.path for e in top if isinstance(e, huggingface_hub.hf_api.RepoFolder)} >= {"unet", "vae_1_0"}
        assert "unet/config.json" not in {e.path for e in top}
        assert sorted(e.path for e in HfApi().list_repo_tree(REPO, "unet")) == sorted(
            p for p in SDXL_BASE_FILES if p.startswith("unet/")
        )
        assert hf_hub_download(REPO, "unet/config.json", revision=commit).endswith(f"{commit}/unet/config.json")

        # Errors are those of the Hub.
        with pytest.raises(RepositoryNotFoundError):  # (3)
            snapshot_download("nobody/no-model")
        with pytest.raises(RepositoryNotFoundError):
            HfApi().repo_info("nobody/no-model", timeout=5)
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download("nobody/no-model", "config.json")
        with pytest.raises(RevisionNotFoundError):
            HfApi().repo_info(REPO, revision="no-such-branch")
        with pytest.raises(EntryNotFoundError):
            hf_hub_download(REPO, "unet/no-such-file.json")


def test_tree_listing_is_paginated(tmp_path, monkeypatch):
    with FakeHub({"o/sd15": fake_repo(SD15_FILES)}, page_size=7) as fake, hub_at(fake, tmp_path, monkeypatch):
        assert sorted(huggingface_hub.list_repo_files("o/sd15")) == sorted(SD15_FILES)
        pages = [p for m, p in fake.requests if "/tree/" in p]
        assert len(pages) > len(SD15_FILES) // 7 and "cursor=" in pages[-1]
        folder = snapshot_download("o/sd15", allow_patterns=["*.json"])
        assert sorted(f.path for f in get_cached_repo_tree("o/sd15")) == sorted(SD15_FILES)
        assert sorted(fake.downloaded("o/sd15")) == sorted(p for p in SD15_FILES if p.endswith(".json"))
        assert os.path.isfile(os.path.join(folder, "feature_extractor/preprocessor_config.json"))


def test_add_repo_makes_a_new_commit(tmp_path, monkeypatch):
    with FakeHub() as fake, hub_at(fake, tmp_path, monkeypatch):
        first = fake.add_repo("o/n", {"config.json": b"{}"})
        assert open(hf_hub_download("o/n", "config.json")).read() == "{}"
        second = fake.add_repo("o/n", {"config.json": b'{"a": 1}'})
        assert second != first
        assert open(hf_hub_download("o/n", "config.json")).read() == '{"a": 1}'
        assert fake.downloaded("o/n") == ["config.json", "config.json"]


def test_no_network(fake, tmp_path, monkeypatch):
    with hub_at(None, tmp_path, monkeypatch) as endpoint:
        assert endpoint != fake.url
        start = time.monotonic()
        with pytest.raises(httpx2.ConnectError):  # (4)
            HfApi().repo_info(REPO, timeout=2)
        with pytest.raises(LocalEntryNotFoundError):  # nothing cached: snapshot_download gives up at once
            snapshot_download(REPO)
        assert time.monotonic() - start < 3
    assert fake.requests == []


def test_hub_at_without_monkeypatch_restores_everything(fake, tmp_path):
    before = (
        huggingface_hub.constants.ENDPOINT,
        huggingface_hub.constants.HF_HUB_CACHE,
        huggingface_hub.hf_api.api.endpoint,
        huggingface_hub.constants.HF_HUB_OFFLINE,
    )
    with hub_at(fake, tmp_path):
        assert huggingface_hub.hf_api.api.endpoint == fake.url
        assert huggingface_hub.constants.HF_HUB_CACHE == str(tmp_path.resolve())
    after = (
        huggingface_hub.constants.ENDPOINT,
        huggingface_hub.constants.HF_HUB_CACHE,
        huggingface_hub.hf_api.api.endpoint,
        huggingface_hub.constants.HF_HUB_OFFLINE,
    )
    assert after == before
