"""The ``kvformat`` argument parser: subcommands, options, help texts, examples and exit codes.

Parsing only; :mod:`kvformat.cli` dispatches and renders.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..layout import PLATFORMS
from ._util import MAX_JOBS, int_arg, jobs_arg, layers_arg, mode_arg, size_arg

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 3, 130, 141
EXIT_CODES = {
    EXIT_OK: "success: everything checked is good",
    EXIT_BAD: "bad files found (corrupt, misplaced, replicas differ) or some files failed to convert",
    EXIT_USAGE: "usage error, a path that is not a kvformat/legacy root, unreadable input or metadata, "
                "a legacy layout that needs --page-bytes, an I/O error",
    EXIT_INTERNAL: "internal error: a bug in kvformat (set KVFORMAT_DEBUG=1 for the traceback; please report it)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE: "stdout closed early (e.g. piped into head): stops quietly, as a tool killed by SIGPIPE does",
}
_SIZES = "SIZE: 1000000, 500G, 1.5TB, 64MiB (K/M/G/T/P = powers of 1000, KiB..PiB = powers of 1024)"


def _exit_codes_text() -> str:
    return "exit codes:\n" + "\n".join(f"  {c:<4} {t}" for c, t in EXIT_CODES.items())


def _epilog(examples: str) -> str:
    return f"examples:\n{examples}\n\n{_exit_codes_text()}\n\n--json schema: docs/schema/kvformat-cli.schema.json."


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks; shows defaults in the option help where they are stated."""


def _sub(sub: Any, name: str, help_: str, description: str, examples: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_, description=description, epilog=_epilog(examples),
                                                formatter_class=_Formatter)
    return p


def _common(s: argparse.ArgumentParser, *, progress: bool = True) -> None:
    s.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout, not text (schema: docs/schema/kvformat-cli.schema.json)")
    if progress:
        s.add_argument("--quiet", "-q", action="store_true",
                       help="no progress bar (progress is drawn on stderr only when it is a terminal)")


def _path(s: argparse.ArgumentParser) -> argparse.ArgumentParser:
    s.add_argument("path", metavar="PATH",
                   help="a .kvf file, a kvformat root or namespace directory, a legacy root or .bin file, or a URL")
    return s


_KEY_HELP = ("a seal key source (spec §12): a key file path or env:NAME, never the key itself; repeat it for "
             "several keys")


def _keys(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--key", dest="keys", action="append", default=[], metavar="SOURCE", help=f"{_KEY_HELP}. {what}")


def _reading(s: argparse.ArgumentParser, jobs: int, what: str) -> None:
    """The options inspect and verify end with: --jobs (``what`` the threads do), --page-bytes, --json, --quiet."""
    s.add_argument("--jobs", "-j", type=jobs_arg, default=jobs, metavar="N",
                   help=f"{what} (1..{MAX_JOBS}, default {jobs})")
    s.add_argument("--page-bytes", type=int_arg(1, what="a byte count"), default=None, metavar="N",
                   help="legacy roots: bytes of one block of one layer, when the file size allows several layouts")
    _common(s)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvformat`` argument parser (every subcommand, its help and examples)."""
    p = argparse.ArgumentParser(
        prog="kvformat", formatter_class=_Formatter,
        description="Inspect, verify, compact and bound kvformat KV-cache roots (and vLLM fs-tier caches).",
        epilog=_epilog("  kvformat demo                                # the whole story, no flags (~2 s)\n"
                       "  kvformat inspect /cache                      # per namespace: files, bytes, TP sizes, age\n"
                       "  kvformat verify /cache --quarantine          # full checksum pass, bad files moved aside\n"
                       "  kvformat compact /vllm-fs-cache /cache -j 2  # vLLM fs-tier rows -> kvformat files\n"
                       "  kvformat gc /cache --max-bytes 500GiB        # evict least recently used files\n\n"
                       + _SIZES))
    from ..format import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for add in (_add_inspect, _add_verify, _add_compact, _add_gc, _add_demo):
        add(sub)
    return p


def _add_inspect(sub: Any) -> None:
    s = _sub(sub, "inspect", "show a file, a kvformat root or a legacy vLLM fs-tier root",
             "Show one file (header, layout table, key, provenance, checksums) or a root (one row per namespace).",
             "  kvformat inspect /cache\n  kvformat inspect /cache --verify --json\n"
             "  kvformat inspect /cache/<namespace>/ab/cd/<hash>.kvf\n"
             "  kvformat inspect /cache/<namespace>/ab/cd/<hash>.kvf --key /etc/kvformat/seal.key")
    _path(s)
    _keys(s, "Sealed files' seal level and key id show without a key; with their key the tag is checked too.")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--verify", dest="verify", action="store_true", default=None,
                   help="also check every payload (default for one file; directories check headers only)")
    g.add_argument("--no-verify", dest="verify", action="store_false", help="read headers only, even for one file")
    _reading(s, 4, "threads checking payloads with --verify")


def _add_verify(sub: Any) -> None:
    s = _sub(sub, "verify", "full checksum and placement pass over a file or a root",
             "Check every block file exactly as a load does: header, key and namespace against its path, "
             "checksums of header and payload. On a legacy vLLM root: sizes and worker replicas.",
             "  kvformat verify /cache\n  kvformat verify /cache --quarantine --json\n"
             "  kvformat verify s3://bucket/cache --jobs 8\n"
             "  kvformat verify /cache --key /etc/kvformat/seal.key --key env:OLD_SEAL_KEY")
    _path(s).add_argument("--quarantine", action="store_true", help="move bad kvformat block files to "
                          "<root>/.quarantine/<path>.<Reason> (never other files; never a sealed file under a "
                          "key not given)")
    _keys(s, "Sealed files are then authenticated (their tag checked); without --key, only what needs no key "
          "(header and stored-data checksums), and a sealed file under a key not given counts as bad.")
    _reading(s, 2, "threads reading and hashing payloads")


def _add_compact(sub: Any) -> None:
    s = _sub(sub, "compact", "convert a legacy vLLM fs-tier root into kvformat files",
             "Write each legacy block once, TP-independent, after checking its worker replicas agree. "
             "Idempotent and resumable: a re-run verifies existing outputs (payload included) and rewrites bad ones.",
             "  kvformat compact /vllm-fs-cache /cache -j 2\n  kvformat compact /vllm-fs-cache /cache --dry-run\n"
             "  kvformat compact /vllm-fs-cache /cache --delete-source --mode 0640\n"
             "  kvformat compact /vllm-fs-cache /cache --seal encrypt --key /etc/kvformat/seal.key\n"
             "  kvformat compact /tmp/hicache /cache --from sglang --model deepseek-ai/DeepSeek-V3 --layers 61 "
             "--page-size 64 --host-layout page_first")
    s.add_argument("src", metavar="SRC", help="the legacy root (the fs tier's root directory)")
    s.add_argument("dst", metavar="DST", help="the kvformat root to write (a directory or a URL that outlives "
                   "this process; memory:// is refused)")
    s.add_argument("--jobs", "-j", type=jobs_arg, default=1, metavar="N",
                   help=f"threads converting files (1..{MAX_JOBS}, default 1)")
    s.add_argument("--dry-run", "-n", action="store_true", help="print what would be written and the bytes saved; "
                   "write nothing")
    s.add_argument("--delete-source", action="store_true",
                   help="remove each source file after its output is written and read back verified")
    s.add_argument("--page-bytes", type=int_arg(1, what="a byte count"), default=None, metavar="N",
                   help="bytes of one block of one layer, when the file size allows several layouts")
    s.add_argument("--pp-layers", type=layers_arg, default=None, metavar="N,N,...",
                   help="a pipeline-parallel writer's partition: decoder layers per stage (e.g. 31,30; vLLM's "
                        "get_pp_indices or VLLM_PP_LAYER_PARTITION); config.json names stage 0's layers only")
    s.add_argument("--cp-interleave", type=int_arg(1, 1 << 16, "a token count"), default=None, metavar="N",
                   help="a DCP writer's cp_kv_cache_interleave_size: required for a tree written with DCP "
                        "(config.json omits it; no default: a wrong one misplaces every token)")
    s.add_argument("--platform", choices=PLATFORMS, default=None,
                   help="the writer's platform, required when it decides the bytes (FP8 caches, the DSA indexer): "
                        "cuda, cuda-mx (SM100: UE8M0 indexer scales), rocm (OCP fp8), rocm-fnuz (gfx942)")
    s.add_argument("--codec", choices=("none", "zstd"), default="none", help="payload codec (default none)")
    s.add_argument("--level", type=int_arg(0, 22, "a zstd level"), default=3, metavar="N",
                   help="zstd level 0..22 (default 3; used with --codec zstd)")
    s.add_argument("--seal", choices=("authenticate", "encrypt"), default=None,
                   help="write sealed files (spec §12) under the first --key: authenticate (tag over header and "
                        "payload) or encrypt (payload encrypted too). Needs --codec none")
    _keys(s, "With --seal, the first seals the outputs; all of them open existing outputs on a re-run.")
    s.add_argument("--fsync", action="store_true", help="fsync each output before counting it done")
    _add_sglang_source(s)
    s.add_argument("--mode", type=mode_arg, default=None, metavar="MODE",
                   help="octal mode of the files written (e.g. 0640; directories created get x where r is set). "
                        "Default: 0644 and 0755 filtered by the umask")
    _common(s)


def _add_sglang_source(s: argparse.ArgumentParser) -> None:
    sg = s.add_argument_group("SGLang's file backend (--from sglang: SRC is its file_storage_path; its files do not "
                             "say their layout, so the deployment's facts are given)")
    sg.add_argument("--from", dest="source", choices=("vllm", "sglang"), default="vllm",
                   help="the source tree: vLLM's fs tier (default) or SGLang's HiCacheFile backend")
    sg.add_argument("--model", default=None, help="the model SGLang served (its served model name)")
    sg.add_argument("--layers", dest="n_layers", type=int_arg(1, 4096, "a layer count"), default=None, metavar="N",
                   help="layers in a page (the host pool's layer_num)")
    sg.add_argument("--page-size", type=int_arg(1, 1 << 20, "a token count"), default=None, metavar="N",
                   help="tokens per page (SGLang's --page-size)")
    sg.add_argument("--host-layout", choices=("layer_first", "page_first", "page_first_direct"), default=None,
                   help="SGLang's --hicache-mem-layout of the writer")
    sg.add_argument("--kv-dtype", default="bfloat16",
                   help="bfloat16 (default), float16, float32, fp8_e4m3 or fp8_e5m2")
    sg.add_argument("--width", type=int_arg(1, 1 << 16, "a latent width"), default=576, metavar="N",
                   help="latent values per token (kv_lora_rank + qk_rope_head_dim; default 576)")
    sg.add_argument("--revision", default=None, help="the model revision (part of the identity)")
    sg.add_argument("--key-scheme", choices=("engine", "token-chain"), default="engine",
                   help="the namespace to write: SGLang's own (default) or the one shared with vLLM")
    sg.add_argument("--rope", choices=("interleaved", "neox"), default=None, help="RoPE convention (token-chain)")


def _add_gc(sub: Any) -> None:
    s = _sub(sub, "gc", "evict least recently used files until a root is under a size; purge quarantine",
             "Evict block files, oldest mtime first, until the root holds at most SIZE; remove stale temp files. "
             "Works on a kvformat root only and deletes only block files inside its namespaces. "
             "Safe while a tier serves from ROOT.",
             "  kvformat gc /cache --max-bytes 500GiB --dry-run\n  kvformat gc /cache --max-bytes 1.5TB\n"
             "  kvformat gc /cache --quarantine\n\n" + _SIZES)
    s.add_argument("root", metavar="ROOT", help="a kvformat root (directory or URL); not a namespace, not a "
                   "directory of several roots")
    s.add_argument("--max-bytes", type=size_arg, default=None, metavar="SIZE",
                   help="bound on the bytes of block files; 0 means no limit (as for the tier's max_bytes)")
    s.add_argument("--quarantine", action="store_true",
                   help="also delete every file under ROOT/.quarantine (local roots)")
    s.add_argument("--dry-run", "-n", action="store_true",
                   help="list what would be deleted, in the words a real run uses; delete nothing")
    _common(s)


def _add_demo(sub: Any) -> None:
    s = _sub(sub, "demo", "the whole story on a small DeepSeek-shaped cache, in a temp directory",
             "Write a TP=8 legacy cache, inspect it, compact it, read it back at TP=2 and TP=1, catch a corrupt file.",
             "  kvformat demo\n  kvformat demo --dir /tmp/kvf-demo --layers 4 --blocks 4")
    s.add_argument("--dir", default=None, metavar="DIR", help="work here instead of a temp directory (kept)")
    s.add_argument("--layers", type=int_arg(1, 61, "a layer count"), default=8, metavar="N",
                   help="MLA layers per block, 1..61 (default 8)")
    s.add_argument("--blocks", type=int_arg(1, 4096, "a block count"), default=12, metavar="N",
                   help="blocks to write, 1..4096 (default 12)")
    _common(s, progress=False)
