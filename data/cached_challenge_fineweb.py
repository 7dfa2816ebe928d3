"""Download the challenge's published FineWeb exports from the Hugging Face hub.

    python data/cached_challenge_fineweb.py --variant sp1024|sp4096|sp8192|sp8192_caseops [--train-shards N]
    python data/cached_challenge_fineweb.py --with-docs [--variant ...]

fetches the variant's tokenizer, every val shard and the first N train shards
(all of them when the export publishes fewer; an sp1024 shard holds 100M
tokens) from a Hugging Face dataset repo into, relative to this script's folder:

    datasets/fineweb10B_sp<V>/fineweb_{val,train}_XXXXXX.bin
    tokenizers/fineweb_<V>_bpe.{model,vocab}
    datasets/manifest.json   (the manifest of the last download, for reference)

    variant  dataset repo                 default N
    sp1024   willdepueoai/parameter-golf  80  (the challenge's export)
    sp4096   kevclark/parameter-golf      143 (what the sp4096 records downloaded)
    sp8192   kevclark/parameter-golf      128 (what the sp8192 records downloaded)
    sp8192_caseops  romeerp/parameter-golf-caseops-v1  80 (the CaseOps records' export)

sp8192_caseops (SPEC-FRONTIER 2) keeps the export's names:
datasets/fineweb10B_sp8192_lossless_caps_caseops_v1_reserved/ with, beside the
shards, the val byte sidecars fineweb_val_bytes_XXXXXX.bin (one per val shard),
and tokenizers/fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model. After
the download its train shards are checked for validation documents (pitfall 6
of SPEC-FRONTIER 17): more than VAL_OVERLAP_TOLERANCE of them is an error.

MATCHED_FINEWEB_REPO_ID, when set, replaces the repo of every variant; the
repo used is printed first. Every repo is read the same way: the export
lives in its datasets/ folder and datasets/manifest.json lists the files (without
a manifest the conventional file names are used). Shards already on disk with a
valid header and size are skipped, so an interrupted download can simply be
run again. Without network access use build_sample_data.py.

--with-docs fetches the challenge's documents, from which its exports were
tokenized and build_shards.py builds any variant: datasets/docs_selected.jsonl
and its datasets/docs_selected.source_manifest.json from the challenge's repo
(willdepueoai/parameter-golf, or MATCHED_FINEWEB_REPO_ID). The documents are
checked against that manifest (its document count, and its sha256 and byte
size where it gives them) before they are moved into place; a copy already
there is checked the same way and kept when it passes. An interrupted download
resumes where it stopped (huggingface_hub keeps the partial file in the staging
folder) when run again.
"""

import hashlib
import http.client
import json
import os
import posixpath
import shutil
import socket
import ssl
import sys
import urllib.error
import urllib.request

import numpy as np

from shards import (VAL_OVERLAP_TOLERANCE, OneLineParser, UsageError, read_shard, run_command, shard_num_tokens,
                    val_documents_in_train)

# huggingface_hub (imported lazily below) reads these when it is imported; they
# bound each network wait.
os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "60")

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ENV = "MATCHED_FINEWEB_REPO_ID"  # overrides the repo of every variant
REMOTE_ROOT = "datasets"  # the export lives in this folder of the repo
MANIFEST = "manifest.json"
# variant -> (dataset folder, tokenizer name, dataset repo, default train shards).
# sp1024 is the challenge's own export; the sp4096 and sp8192 exports are the ones
# the records with those vocabularies used, and their defaults are the train shard
# counts those records fetched.
VARIANTS = {
    "sp1024": ("fineweb10B_sp1024", "fineweb_1024_bpe", "willdepueoai/parameter-golf", 80),
    "sp4096": ("fineweb10B_sp4096", "fineweb_4096_bpe", "kevclark/parameter-golf", 143),
    "sp8192": ("fineweb10B_sp8192", "fineweb_8192_bpe", "kevclark/parameter-golf", 128),
    "sp8192_caseops": ("fineweb10B_sp8192_lossless_caps_caseops_v1_reserved",
                       "fineweb_8192_bpe_lossless_caps_caseops_v1_reserved", "romeerp/parameter-golf-caseops-v1", 80),
}
# Variants whose val shards come with byte sidecars and whose train shards are checked for val documents.
DOCUMENT_VARIANTS = ("sp8192_caseops",)
BOS_ID = 1
MAX_TRAIN_SHARDS = 1000  # sanity bound; the manifest gives the real count
OFFLINE_HINT = ("check your network or set HF_ENDPOINT; "
                "for an offline sample run use python data/build_sample_data.py")


class FetchError(Exception):
    """A download or validation failure: one stderr line, exit status 1."""


class RemoteFileMissing(Exception):
    """The hub answered, but the repo has no such file."""


DOCS = "docs_selected.jsonl"  # the challenge's document stream (--with-docs)
DOCS_MANIFEST = "docs_selected.source_manifest.json"
DOCS_REPO = VARIANTS["sp1024"][2]


def parse_args(argv):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    repos = "; ".join(f"{v} from {VARIANTS[v][2]}" for v in sorted(VARIANTS))
    p.add_argument("--with-docs", action="store_true",
                   help=f"also fetch the challenge's documents ({DOCS} and {DOCS_MANIFEST}, from {DOCS_REPO})")
    p.add_argument("--variant",
                   help=f"tokenizer variant of the export: {repos} ({REPO_ENV} replaces the repo)")
    defaults = ", ".join(f"{v} {VARIANTS[v][3]}" for v in sorted(VARIANTS))
    p.add_argument("--train-shards", type=int, default=None,
                   help=f"number of train shards to fetch, 0..{MAX_TRAIN_SHARDS} "
                        f"(default per variant: {defaults}; all published if fewer)")
    args = p.parse_args(argv)
    if args.variant is None and not args.with_docs:
        raise UsageError("give --variant, --with-docs or both")
    if args.variant is not None and args.variant not in VARIANTS:
        raise UsageError(f"unknown --variant {args.variant!r}; choose from {', '.join(sorted(VARIANTS))}")
    if args.train_shards is not None and not 0 <= args.train_shards <= MAX_TRAIN_SHARDS:
        raise UsageError(f"--train-shards must be in 0..{MAX_TRAIN_SHARDS}, got {args.train_shards}")
    return args


# ---------------------------------------------------------------- hub access

def _root_cause(exc):
    """'Type: message' of the most specific non-huggingface_hub error in exc's chain."""
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    outside = [e for e in chain if not type(e).__module__.startswith("huggingface_hub")]
    cause = (outside or chain)[0]
    text = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def _is_connection_error(exc):
    from huggingface_hub.utils import LocalEntryNotFoundError

    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        # requests raises OSError subclasses, httpx its own TransportErrors.
        if isinstance(exc, (LocalEntryNotFoundError, ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if any(cls.__name__ in ("TransportError", "ConnectionError", "Timeout") for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _unreachable(what, cause):
    from huggingface_hub import constants

    return FetchError(f"could not reach the Hugging Face hub at {constants.ENDPOINT} to download {what} "
                      f"({cause}); {OFFLINE_HINT}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect is an answer; do not follow it


def check_hub_reachable(repo_id, remote_path):
    """Fail fast, in one line, when the hub cannot be reached at all.

    huggingface_hub retries a failing connection for half a minute or more
    before giving up, so an offline machine gets one direct probe first. Any
    HTTP answer, even an error status, shows that the hub is reachable; so does
    a TLS failure, which is left to huggingface_hub's own certificate handling.
    """
    from huggingface_hub import constants, hf_hub_url

    url = hf_hub_url(repo_id, remote_path, repo_type="dataset")
    request = urllib.request.Request(url, method="HEAD")
    try:
        urllib.request.build_opener(_NoRedirect).open(request, timeout=constants.HF_HUB_ETAG_TIMEOUT).close()
    except urllib.error.HTTPError:
        pass
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        cause = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
        if not isinstance(cause, ssl.SSLError):
            text = (str(cause).strip().splitlines() or [""])[0][:200]
            raise _unreachable(f"{remote_path} from {repo_id}", f"{type(cause).__name__}: {text}") from None


def hub_download(repo_id, remote_path, staging_dir):
    """Download a file of dataset repo repo_id into staging_dir; return its local path.

    Raises RemoteFileMissing when the repo has no such file, FetchError otherwise.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils import (EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError)

    what = f"{remote_path} from {repo_id}"
    try:
        return hf_hub_download(repo_id, remote_path, repo_type="dataset", local_dir=staging_dir)
    except Exception as e:  # noqa: BLE001  (classified below)
        if isinstance(e, EntryNotFoundError) and not isinstance(e, LocalEntryNotFoundError):
            raise RemoteFileMissing(what) from None
        if isinstance(e, RepositoryNotFoundError):
            raise FetchError(f"dataset repo {repo_id} not found or not accessible on {constants.ENDPOINT} "
                             f"({_root_cause(e)}); check {REPO_ENV}") from None
        if _is_connection_error(e):
            raise _unreachable(what, _root_cause(e)) from None
        if isinstance(e, HfHubHTTPError):
            raise FetchError(f"the Hugging Face hub refused {what} ({_root_cause(e)})") from None
        raise FetchError(f"downloading {what} failed ({_root_cause(e)})") from None


# ------------------------------------------------------------------ manifest

def _named_entries(manifest, section):
    """manifest[section] as {name: entry}; it may be a list of {'name': ...} or a dict."""
    value = manifest.get(section)
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items() if isinstance(v, dict)}
    if isinstance(value, list):
        return {str(e["name"]): e for e in value if isinstance(e, dict) and "name" in e}
    return {}


def _split_files(entry, split):
    """File names of one split of a dataset entry: an explicit list, or a count
    turned into the conventional names. None when the entry says neither."""
    stats = entry.get("stats") if isinstance(entry.get("stats"), dict) else {}
    for source in (entry, stats):
        for key in (f"{split}_files", f"files_{split}", f"{split}_shards", f"num_{split}_shards"):
            value = source.get(key)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return [posixpath.basename(v) for v in value]
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return [f"fineweb_{split}_{i:06d}.bin" for i in range(value)]
    return None


def _tokenizer_paths(manifest, tokenizer_name):
    """Repo paths (under REMOTE_ROOT) of the tokenizer's files."""
    conventional = [f"tokenizers/{tokenizer_name}.model", f"tokenizers/{tokenizer_name}.vocab"]
    entry = _named_entries(manifest, "tokenizers").get(tokenizer_name)
    if entry is None:
        return conventional
    paths = []
    for key in ("model_path", "vocab_path", "path"):
        value = entry.get(key)
        if isinstance(value, str) and value:
            # Paths are relative to the export root; an absolute one (from the
            # machine that built the export) only tells us the file name.
            value = value.replace("\\", "/")
            paths.append(f"tokenizers/{posixpath.basename(value)}" if value.startswith("/")
                         else posixpath.normpath(value))
    return paths or conventional


def plan_from_manifest(manifest, variant, repo_id):
    """(val shard names, train shard names, tokenizer repo paths) of a variant.

    Raises FetchError with a one-line reason when the manifest cannot be read.
    """
    dataset, tokenizer_name = VARIANTS[variant][:2]
    if not isinstance(manifest, dict):
        raise FetchError(f"{REMOTE_ROOT}/{MANIFEST} of {repo_id}: expected a JSON object, "
                         f"got {type(manifest).__name__}")
    datasets = _named_entries(manifest, "datasets")
    if dataset not in datasets:
        known = ", ".join(sorted(datasets)) or "none"
        raise FetchError(f"{REMOTE_ROOT}/{MANIFEST} of {repo_id} does not list dataset {dataset} "
                         f"(it lists: {known})")
    entry = datasets[dataset]
    val_files, train_files = _split_files(entry, "val"), _split_files(entry, "train")
    if not val_files or train_files is None:
        raise FetchError(f"cannot tell the val/train shard files of {dataset} from {REMOTE_ROOT}/{MANIFEST} "
                         f"of {repo_id} (entry keys: {', '.join(sorted(entry))})")
    for key in ("tokenizer_name", "tokenizer"):
        if isinstance(entry.get(key), str) and entry[key]:
            tokenizer_name = entry[key]
            break
    return val_files, train_files, _tokenizer_paths(manifest, tokenizer_name)


def conventional_plan(variant, train_shards):
    tokenizer_name = VARIANTS[variant][1]
    return (["fineweb_val_000000.bin"],
            [f"fineweb_train_{i:06d}.bin" for i in range(train_shards)],
            [f"tokenizers/{tokenizer_name}.model", f"tokenizers/{tokenizer_name}.vocab"])


# ----------------------------------------------------------------- transfers

def _valid_shard(path):
    try:
        shard_num_tokens(path)
        return True
    except (OSError, ValueError):
        return False


def fetch(repo_id, remote_path, dest, staging_dir):
    """Download REMOTE_ROOT/remote_path of repo_id to dest unless a good copy is already there."""
    is_shard = dest.endswith(".bin")
    if os.path.exists(dest):
        if is_shard and not _valid_shard(dest):
            print(f"re-downloading incomplete or corrupt {dest}")
            os.remove(dest)
        elif os.path.getsize(dest) > 0:
            print(f"exists: {dest}")
            return
    try:
        staged = hub_download(repo_id, f"{REMOTE_ROOT}/{remote_path}", staging_dir)
    except RemoteFileMissing as e:
        raise FetchError(f"{e} does not exist (is the export incomplete, or --train-shards too large?)") from None
    if is_shard:
        try:
            shard_num_tokens(staged)
        except ValueError as e:
            os.remove(staged)
            raise FetchError(f"downloaded {remote_path} is not a valid shard ({e}); run again to retry") from None
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if os.path.islink(staged):  # old huggingface_hub versions link big files into their cache
        tmp = dest + ".tmp"
        shutil.copyfile(os.path.realpath(staged), tmp)
        os.replace(tmp, dest)
        os.remove(staged)
    else:
        os.replace(staged, dest)  # same file system: atomic, no second copy
    print(f"fetched: {dest} ({os.path.getsize(dest) / 1e6:.1f} MB)")


def sidecar_name(val_name):
    """fineweb_val_000003.bin -> fineweb_val_bytes_000003.bin"""
    return val_name.replace("fineweb_val_", "fineweb_val_bytes_", 1)


def check_val_not_in_train(dataset_dir, val_files, train_files):
    """Pitfall 6 (SPEC-FRONTIER 17): count the val documents that occur in the train shards (fingerprints,
    then exact comparison; one train shard in memory at a time); FetchError above the tolerance."""
    val = np.concatenate([read_shard(os.path.join(dataset_dir, f)) for f in val_files])
    n_val = max(int((val == BOS_ID).sum()) - 1, 0)
    found = val_documents_in_train(val, (read_shard(os.path.join(dataset_dir, f)) for f in train_files), BOS_ID)
    if found > VAL_OVERLAP_TOLERANCE * n_val:
        raise FetchError(f"{found} of the {n_val} validation documents also occur in the {len(train_files)} train "
                         f"shards in {dataset_dir} (train/val overlap); use an export whose train excludes them")
    print(f"val/train overlap: {found} of {n_val} validation documents found in {len(train_files)} train shards")


def resolve_repo(variant):
    """(dataset repo id, where that choice comes from) for a variant.

    Raises UsageError when MATCHED_FINEWEB_REPO_ID is set to something that is
    not a repo id (checked before any network access).
    """
    default = VARIANTS[variant][2]
    override = os.environ.get(REPO_ENV)
    if override is None:
        return default, f"the default for {variant}; {REPO_ENV} overrides it"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(override)
    except HFValidationError as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"{REPO_ENV}={override!r} is not a Hugging Face repo id ({reason})") from None
    return override, f"from {REPO_ENV}; the default for {variant} is {default}"


def download(variant, train_shards):
    dataset, _, _, default_shards = VARIANTS[variant]
    repo_id, origin = resolve_repo(variant)
    dataset_dir = os.path.join(DATA_DIR, "datasets", dataset)
    tokenizer_dir = os.path.join(DATA_DIR, "tokenizers")
    # Downloads land here first and are moved into place once complete; the
    # folder sits outside dataset_dir so its files never match the shard globs.
    staging_dir = os.path.join(DATA_DIR, "datasets", ".hf_staging")
    requested = default_shards if train_shards is None else train_shards
    print(f"source: dataset repo {repo_id} ({origin})")

    manifest_remote = f"{REMOTE_ROOT}/{MANIFEST}"
    check_hub_reachable(repo_id, manifest_remote)
    try:
        staged = hub_download(repo_id, manifest_remote, staging_dir)
    except RemoteFileMissing:
        staged = None
    if staged is not None:
        try:
            with open(staged, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise FetchError(f"{manifest_remote} of {repo_id} is not readable JSON ({e})") from None
        val_files, train_files, tokenizer_paths = plan_from_manifest(manifest, variant, repo_id)
        if requested > len(train_files):
            if train_shards is not None:
                raise UsageError(f"--train-shards {train_shards} is more than the {len(train_files)} "
                                 f"train shards {repo_id} publishes for {variant}")
            print(f"note: {repo_id} publishes {len(train_files)} train shards for {variant}; fetching all")
        train_files = train_files[:requested]
        os.makedirs(os.path.join(DATA_DIR, "datasets"), exist_ok=True)
        os.replace(staged, os.path.join(DATA_DIR, "datasets", MANIFEST))  # kept for reference
    else:
        print(f"note: {repo_id} has no {manifest_remote}; using the conventional file names")
        val_files, train_files, tokenizer_paths = conventional_plan(variant, requested)

    sidecars = []
    if variant in DOCUMENT_VARIANTS:
        val_files = [f for f in val_files if "_bytes_" not in f]
        sidecars = [sidecar_name(f) for f in val_files]
    for path in tokenizer_paths:
        fetch(repo_id, path, os.path.join(tokenizer_dir, posixpath.basename(path)), staging_dir)
    for name in val_files + sidecars + train_files:
        fetch(repo_id, f"datasets/{dataset}/{name}", os.path.join(dataset_dir, name), staging_dir)
    shutil.rmtree(staging_dir, ignore_errors=True)
    if variant in DOCUMENT_VARIANTS:
        check_val_not_in_train(dataset_dir, val_files, train_files)
    print(f"done: {len(val_files)} val and {len(train_files)} train shards from {repo_id} in {dataset_dir}, "
          f"tokenizer in {tokenizer_dir}")


def docs_problem(path, meta):
    """Why the documents at `path` do not match their source manifest `meta` (None when they do): the
    document count (num_docs), and the sha256 (docs_sha256) and byte size (docs_bytes) where given."""
    size = os.path.getsize(path)
    want_size = meta.get("docs_bytes")
    if isinstance(want_size, int) and size != want_size:
        return f"{size} bytes, the manifest says {want_size}"
    digest, lines, last = hashlib.sha256(), 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
            lines += block.count(b"\n")
            last = block[-1:]
    lines += last != b"\n"  # a last line without its newline
    want_docs = meta.get("num_docs")
    if isinstance(want_docs, int) and lines != want_docs:
        return f"{lines} documents, the manifest says {want_docs}"
    want_sha = meta.get("docs_sha256")
    if isinstance(want_sha, str) and digest.hexdigest() != want_sha.lower():
        return f"sha256 {digest.hexdigest()}, the manifest says {want_sha}"
    return None


def download_docs():
    """The challenge's documents and their source manifest into datasets/, checked against the manifest."""
    repo_id = os.environ.get(REPO_ENV) or DOCS_REPO
    if os.environ.get(REPO_ENV):
        resolve_repo("sp1024")  # a bad repo id: one line before the network
    dest_dir = os.path.join(DATA_DIR, "datasets")
    staging_dir = os.path.join(dest_dir, ".hf_staging")
    print(f"documents: dataset repo {repo_id}")
    check_hub_reachable(repo_id, f"{REMOTE_ROOT}/{DOCS_MANIFEST}")
    fetch(repo_id, DOCS_MANIFEST, os.path.join(dest_dir, DOCS_MANIFEST), staging_dir)
    try:
        with open(os.path.join(dest_dir, DOCS_MANIFEST), encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        os.remove(os.path.join(dest_dir, DOCS_MANIFEST))
        raise FetchError(f"{DOCS_MANIFEST} of {repo_id} is not a readable JSON object ({e})") from None
    dest = os.path.join(dest_dir, DOCS)
    if os.path.exists(dest):
        problem = docs_problem(dest, meta)
        if problem is None:
            print(f"exists: {dest} (matches {DOCS_MANIFEST})")
            return dest
        print(f"re-downloading {dest}: {problem}")
        os.remove(dest)
    try:
        staged = hub_download(repo_id, f"{REMOTE_ROOT}/{DOCS}", staging_dir)
    except RemoteFileMissing as e:
        raise FetchError(f"{e} does not exist") from None
    problem = docs_problem(staged, meta)
    if problem is not None:
        os.remove(staged)
        raise FetchError(f"downloaded {DOCS} does not match {DOCS_MANIFEST}: {problem}; run again to retry")
    if os.path.islink(staged):  # old huggingface_hub versions link big files into their cache
        shutil.copyfile(os.path.realpath(staged), dest + ".tmp")
        os.replace(dest + ".tmp", dest)
    else:
        os.replace(staged, dest)
    shutil.rmtree(staging_dir, ignore_errors=True)
    print(f"fetched: {dest} ({os.path.getsize(dest) / 1e9:.2f} GB, {meta.get('num_docs', '?')} documents, "
          f"checked against {DOCS_MANIFEST})")
    return dest


def main(argv=None):
    def body():
        args = parse_args(argv)
        if args.with_docs:
            download_docs()
        if args.variant is not None:
            download(args.variant, args.train_shards)

    return run_command(body, (FetchError, OSError), "interrupted; run again to resume")


if __name__ == "__main__":
    sys.exit(main())
