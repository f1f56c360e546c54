"""Build data/stdlib_docs.jsonl: real English text from the Python stdlib's docstrings.

Each row is one docstring (module, class, function or method) with `label` = the chapter of the
Python Library Reference that documents its module (e.g. "text", "concurrency"), `module` and
`qualname` kept as metadata. Deterministic for a given Python version: modules, members and rows
are sorted. Run: python data/build_stdlib_corpus.py [--out data/stdlib_docs.jsonl]
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

# Chapters of the Library Reference (docs.python.org/3/library/index.html) and some of their modules.
CHAPTERS: dict[str, list[str]] = {
    "text": ["string", "re", "difflib", "textwrap", "unicodedata", "stringprep"],
    "binary-data": ["struct", "codecs"],
    "data-types": ["datetime", "calendar", "collections", "heapq", "bisect", "array", "weakref",
                   "types", "copy", "pprint", "reprlib", "enum", "graphlib"],
    "numeric": ["numbers", "math", "cmath", "decimal", "fractions", "random", "statistics"],
    "functional": ["itertools", "functools", "operator"],
    "files": ["pathlib", "os.path", "stat", "filecmp", "tempfile", "glob", "fnmatch", "shutil"],
    "persistence": ["pickle", "copyreg", "shelve", "marshal", "dbm", "sqlite3"],
    "compression": ["zlib", "gzip", "bz2", "lzma", "zipfile", "tarfile"],
    "file-formats": ["csv", "configparser", "tomllib", "netrc", "plistlib"],
    "crypto": ["hashlib", "hmac", "secrets"],
    "os-services": ["os", "io", "time", "argparse", "logging", "getpass", "platform", "errno", "ctypes"],
    "concurrency": ["threading", "multiprocessing", "concurrent.futures", "subprocess", "sched",
                    "queue", "contextvars", "asyncio"],
    "networking": ["socket", "ssl", "select", "selectors", "signal", "mmap"],
    "internet-data": ["email", "json", "mailbox", "mimetypes", "base64", "binascii", "quopri"],
    "markup": ["html", "html.parser", "xml.etree.ElementTree", "xml.dom.minidom", "xml.sax"],
    "internet-protocols": ["urllib.request", "urllib.parse", "http.client", "http.server", "ftplib",
                           "poplib", "imaplib", "smtplib", "uuid", "socketserver", "http.cookies",
                           "xmlrpc.client", "ipaddress", "webbrowser", "wsgiref"],
    "development": ["typing", "pydoc", "doctest", "unittest", "unittest.mock"],
    "debugging": ["bdb", "faulthandler", "pdb", "timeit", "trace", "tracemalloc", "cProfile", "pstats"],
    "runtime": ["sys", "sysconfig", "builtins", "warnings", "dataclasses", "contextlib", "abc",
                "atexit", "traceback", "gc", "inspect", "site"],
    "language": ["ast", "symtable", "token", "keyword", "tokenize", "tabnanny", "pyclbr",
                 "py_compile", "compileall", "dis", "pickletools"],
    "importing": ["zipimport", "pkgutil", "modulefinder", "runpy", "importlib", "importlib.metadata"],
}
MIN_CHARS = 80
MAX_PER_MODULE = 40


def clean(doc: str) -> str:
    text = inspect.cleandoc(doc)
    return re.sub(r"\s+", " ", text).strip()


def module_rows(chapter: str, module_name: str) -> list[dict]:
    module = importlib.import_module(module_name)
    found: list[tuple[str, str]] = []
    if module.__doc__:
        found.append((module_name, module.__doc__))
    for name, member in sorted(vars(module).items()):
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        if member.__doc__:
            found.append((f"{module_name}.{name}", member.__doc__))
        if inspect.isclass(member):
            for attr, method in sorted(vars(member).items()):
                if not attr.startswith("_") and inspect.isroutine(method) and method.__doc__:
                    found.append((f"{module_name}.{name}.{attr}", method.__doc__))
    rows, seen = [], set()
    for qualname, doc in found:
        text = clean(doc)
        if len(text) < MIN_CHARS or text in seen:
            continue
        seen.add(text)
        rows.append({"text": text, "label": chapter, "module": module_name, "qualname": qualname})
    return rows[:MAX_PER_MODULE]


def build() -> list[dict]:
    rows = []
    for chapter, modules in sorted(CHAPTERS.items()):
        for module_name in sorted(modules):
            rows.extend(module_rows(chapter, module_name))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("stdlib_docs.jsonl"))
    args = parser.parse_args()
    rows = build()
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    labels = sorted({r["label"] for r in rows})
    print(f"wrote {len(rows)} texts, {len(labels)} labels, Python {sys.version.split()[0]} -> {args.out}")


if __name__ == "__main__":
    main()
