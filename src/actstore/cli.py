"""The `actstore` command: inspect, verify and locate stores.

Exit codes: 0 success; 1 `verify` found problems (each printed, naming the file); 2 bad usage, an
unknown path, a directory holding no known format, a store `inspect` cannot summarise or a config
`locate` or `list` cannot read (each named on stderr); 141 (as killed by SIGPIPE) when the output's reader
stopped reading (`| head`), printing nothing more.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
from pathlib import Path

import actstore
from actstore.errors import ActstoreError, ConfigError

SUMMARY_KEYS = ("format", "model", "layers", "n_examples", "n_tokens", "d_model", "dtype", "n_shards", "bytes")
# What a store lost, printed when it lost any: texts cut at max_seq_length, values float16 made inf, the
# activations and the logits (or log-probs) the model computed as NaN or inf (formats.extract.COUNT_KEYS);
# and an extraction's parts so far, while it lacks some.
NOTE_KEYS = ("n_truncated_samples", "float16_overflow_count", "non_finite_count", "non_finite_logits_count",
             "unfinished")
SAE_KEYS = ("format", "model", "hook", "d_in", "num_basis", "k_active", "source", "heldout_fvu", "saelens")
VALIDATE_KEYS = ("format", "stores", "coordinates", "problems")
# --threads past this gains no reads (each thread holds one file) and a store of many files could start
# as many threads, past the process's limit; 2**61 and up overflowed the check's window, and a clean
# store verified as "cannot verify".
MAX_THREADS = 256


def _line(text: str) -> str:
    """`text` as one line of plain text: each character a terminal does not print as itself (a newline,
    an escape, a bidi override; a lone surrogate, a file name's undecodable byte, that stdout cannot
    encode) written as a Python string escape. Names from a store's metadata are printed: a newline
    in one printed a line of its own ("... : OK") among verify's, an escape drove the terminal."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _directory_or_exit(path: Path) -> None:
    """Exit 2 (never 1, which is verify's "problems found") naming `path` unless it is a directory: checked
    first, so that a file named as a stage directory ({dump_to}/sae/<hash>) is not taken for one."""
    if not path.exists():
        print(_line(f"actstore: {path}: no such file or directory"), file=sys.stderr)
        sys.exit(2)
    if not path.is_dir():
        print(_line(f"actstore: {path}: not a directory (a store is a directory: give the one holding this "
                    "file)"), file=sys.stderr)
        sys.exit(2)


def _detect_or_exit(path: Path) -> str:
    from actstore.formats import FORMAT_NAMES, detect_format

    _directory_or_exit(path)
    name = detect_format(path)
    if name is None:
        print(_line(f"actstore: {path}: holds none of the known formats ({', '.join(FORMAT_NAMES)})"),
              file=sys.stderr)
        sys.exit(2)
    return name


def cmd_inspect(args: argparse.Namespace) -> int:
    from actstore.formats import format_module
    from actstore.integrity import links_out, refuse
    from actstore.verify import sae_summary, validate_summary

    _directory_or_exit(args.path)  # before the sae stage's own check, which would name a missing checkpoint
    refuse(links_out(args.path))  # a metadata file linked out would be summarised as the store's
    try:
        if _stage_of(args.path) == "sae":
            info, keys = sae_summary(args.path), SAE_KEYS
        elif _stage_of(args.path) == "validate":
            info, keys = validate_summary(args.path), VALIDATE_KEYS
        else:
            info, keys = format_module(_detect_or_exit(args.path)).inspect(args.path), SUMMARY_KEYS
    except (ValueError, IndexError, OSError) as exc:
        # What a reader did not name itself (an array of another shape, a directory where a file goes):
        # still bad input, exit 2, never a traceback.
        print(_line(f"actstore: {args.path}: cannot be summarised ({type(exc).__name__}: {exc})"),
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        for key in keys + tuple(key for key in NOTE_KEYS if info.get(key)):
            print(_line(f"{key:11s} {info.get(key)}"))
    return 0


def _stage_of(path: Path) -> str | None:
    """The stage of a stage directory ({dump_to}/<stage>/<hash>/) that writes no format's store: "sae"
    (its checkpoint) or "validate" (its report); None for any other path."""
    from actstore.hashing import followed, is_stage_dir

    path = followed(path)
    stage = path.absolute().parent.name
    return stage if is_stage_dir(path) and stage in ("sae", "validate") else None


def cmd_verify(args: argparse.Namespace) -> int:
    from actstore import integrity
    from actstore.formats import FORMAT_NAMES, detect_format, format_module
    from actstore.hashing import followed, is_stage_dir, stage_problems

    # A stage directory's path mistyped or deleted is an unknown path (exit 2), not a stage whose store is gone.
    _directory_or_exit(args.path)
    stage_path = followed(args.path)
    stage = stage_path.absolute().parent.name
    if is_stage_dir(stage_path) and detect_format(args.path) is None:
        # A stage that writes no format's store (sae: the checkpoint), or a format stage whose store is
        # gone (its folder or top metadata deleted, renamed): its stage config's seal is the check, and
        # names the sealed files no longer there.
        what = f"{stage} stage"
        problems = [f"{args.path}: holds no {stage} store (deleted or renamed)"] if stage in FORMAT_NAMES else []
    else:
        name = _detect_or_exit(args.path)
        what = f"{name} store"
        try:
            with integrity.check_threads(args.threads or integrity.CHECK_THREADS):
                problems = format_module(name).verify(args.path)
        except ActstoreError as exc:  # metadata too broken to even open: still a problem naming the file
            problems = [str(exc)]
    problems += stage_problems(stage_path)
    for problem in problems:
        print(_line(f"BAD  {problem}"))
    print(_line(f"{what} {args.path}: " + (f"{len(problems)} problem(s)" if problems else "OK")))
    return 1 if problems else 0


DEFAULT_CONFIG = Path("config/config.yaml")  # the Snakefile's `configfile:`, in the workflow's directory


def cmd_locate(args: argparse.Namespace) -> int:
    from actstore.config import enabled_stages, load_config
    from actstore.dump_listing import stage_state
    from actstore.hashing import stage_dirs

    if not args.directory.is_dir():
        raise ConfigError(f"--directory {args.directory}: not a directory")
    # As Snakemake reads them: --configfile from where the command runs, everything the config names
    # (dump_to, the dataset hashed by its files) from the workflow's working directory.
    configfile = (args.configfile or args.directory / DEFAULT_CONFIG).absolute()
    with contextlib.chdir(args.directory):
        config = load_config(configfile)
        _check_layers(config)
        dirs = stage_dirs(config)
        stale = _stale(config, dirs["extract"])
    located = {stage: str(args.directory / dirs[stage]) for stage in enabled_stages(config)}
    if args.json:
        print(json.dumps(located, indent=2))
    else:
        for stage, directory in located.items():
            state = stage_state(Path(directory))
            print(_line(f"{stage:9s} {directory}  ({state}{', stale' if stale and state == 'done' else ''})"))
        if stale:
            print(_line(f"stale: {stale}"))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from actstore.dump_listing import configs_using, list_dump, listing_json, listing_lines

    if not args.dump_to.is_dir():
        print(_line(f"actstore: {args.dump_to}: not a directory (give a workflow's dump_to)"), file=sys.stderr)
        return 2
    if not args.directory.is_dir():
        raise ConfigError(f"--directory {args.directory}: not a directory")
    used = configs_using(args.dump_to, args.configfile, args.directory) if args.configfile else None
    try:
        listing = list_dump(args.dump_to, used)
    except OSError as exc:  # a member's folder this user may not read, in a lab's shared dump_to
        print(_line(f"actstore: cannot list {args.dump_to}: {exc}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(listing_json(listing), indent=2))
    else:
        for line in listing_lines(listing):
            print(_line(line))
    return 0


def _check_layers(config: dict) -> None:
    """ConfigError for an extract.layers block past the model's, as the workflow's parse refuses it
    (model_config.check_layers): locate printed the directories of a run that never starts, and exited 0.
    A config whose model folder is not here (a copied dump_to) is taken at its word, as _stale takes it."""
    from actstore.model_config import check_layers, resolve_model_path, run_config

    try:
        resolve_model_path(config["model"]["path"])
    except ConfigError:
        return
    check_layers(config["extract"]["layers"], run_config(config["model"]))


def _stale(config: dict, extract_dir: Path) -> str:
    """Why the finished extraction no longer holds what the config names (its model folder given other
    weights, its path-hashed data changed: the parse's checks, which stop the next run), or "". Every
    stage read it: `done` alone said a store of the old weights or rows was the config's."""
    from actstore.datasets import check_extraction_data_unchanged, resolve_source
    from actstore.model_config import resolve_model_path
    from actstore.model_identity import check_model_unchanged

    try:
        model = resolve_model_path(config["model"]["path"])
    except ConfigError:  # no model folder here (a copied dump_to): nothing to compare, as the parse finds
        model = None
    dataset = config["dataset"]
    try:
        source = resolve_source(dataset["path"], dataset.get("format", "auto"), dataset.get("split", "train"))
    except ConfigError:  # likewise the data
        source = None
    try:
        if model is not None:
            check_model_unchanged(model, extract_dir)
        if source is not None:  # given, not listed again (an image folder's listing: seconds)
            check_extraction_data_unchanged(dataset, extract_dir, source=source)
    except ActstoreError as exc:  # a scan or part.json damaged (FormatError) stops the next run's parse too
        return str(exc)
    return ""


def _thread_count(text: str) -> int:
    """A whole number from 1 to MAX_THREADS (argparse reports anything else as bad usage, exit code 2)."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1 and at most {MAX_THREADS}")
    return int(text)


def _command(sub: argparse._SubParsersAction, name: str, what: str) -> argparse.ArgumentParser:
    """A subcommand whose own --help says what it does (argparse shows `help` only in the list)."""
    return sub.add_parser(name, help=what, description=what)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actstore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # what a bug report names (the extraction records it too, in its part metadata's versions)
    parser.add_argument("--version", action="version", version=f"%(prog)s {actstore.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = _command(sub, "inspect", "detect a store's format and summarise it (or an sae stage "
                       "directory's SAE)")
    inspect.add_argument("path", type=Path, help="a store, or the workflow stage directory holding it")
    inspect.add_argument("--json", action="store_true", help="print the full summary as JSON")
    inspect.set_defaults(func=cmd_inspect)
    verify = _command(sub, "verify", "full integrity check: files, sizes, sha256, spec fields (exit 1 on problems)")
    verify.add_argument("path", type=Path, help="a store, or the workflow stage directory holding it (the "
                        "sae stage's too: its files against the stage config's seal)")
    verify.add_argument("--threads", type=_thread_count, default=None,
                        help=f"files checked at once, at most {MAX_THREADS} (default: the CPUs this process may "
                        "use, at most 8)")
    verify.set_defaults(func=cmd_verify)
    locate = _command(sub, "locate", "print each enabled stage's output directory for a config, and whether "
                      "it is done (its stage config written), incomplete or not built")
    locate.add_argument("-d", "--directory", type=Path, default=Path("."),
                        help="the workflow's working directory (snakemake's -d, else where it ran), from which "
                        "the config's relative paths are read (default: the current directory)")
    locate.add_argument("--configfile", type=Path, default=None,
                        help=f"the workflow config (default: {DEFAULT_CONFIG} in --directory)")
    locate.add_argument("--json", action="store_true", help="print {stage: directory} as JSON")
    locate.set_defaults(func=cmd_locate)
    listing = _command(sub, "list", "print every stage directory under a dump_to ({dump_to}/{stage}/{hash}/): its "
                       "state (done, incomplete, damaged: its stage config unreadable or edited, or temp: a writer's "
                       "temp or lock file left, a run writing now or killed: never delete it while one may run), "
                       "its size on disk, when written, the extraction it was made from, and which --configfile "
                       "names it; other entries (logs/) by size. Deletes nothing, hashes nothing (`actstore "
                       "verify` checks a store)")
    listing.add_argument("dump_to", type=Path, help="the workflow's dump_to directory")
    listing.add_argument("--configfile", type=Path, action="append", default=[],
                         help="a workflow config whose stage directories to mark as used (repeat for several; "
                         "each must name this dump_to)")
    listing.add_argument("-d", "--directory", type=Path, default=Path("."),
                         help="the workflow's working directory, from which each config's relative paths are read, "
                         "as locate reads them (default: the current directory)")
    listing.add_argument("--json", action="store_true", help="print a list of objects, one per stage directory "
                         "(its fields as printed, bytes exact), then one of state \"other\" per other entry")
    listing.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A character stdout's encoding lacks (a CJK path where LANG is latin-1) escaped, as stderr does: print
        # raised UnicodeEncodeError after the check, a traceback and verify's exit 1 for a clean store.
        sys.stdout.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a pipe closed early (`| head`) is then caught below
        return code
    except ActstoreError as exc:
        print(_line(f"actstore: {exc}"), file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader stopped reading (`actstore verify STORE | head`): end quietly, as a command killed by
        # SIGPIPE does, not with a traceback; the exit's own flush then writes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
