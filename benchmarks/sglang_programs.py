"""SGLang's own frontend test programs (`python/sglang/test/test_programs.py` of the SGLang repository), run unchanged
against radixserve, as SGLang's `test_srt_backend.py` runs them against its server:

    python benchmarks/sglang_programs.py --programs PATH/test_programs.py [--only test_select,test_regex]

The file is read from where the user keeps it (it is SGLang's, not shipped here). Its imports resolve to radixserve:
`sglang` is radixserve, `sglang.lang.ir` is `radixserve.frontend` (the REGEX_* constants live there) and
`sglang.srt.hf_transformers_utils.get_tokenizer` loads the served model's tokenizer, and `sglang.utils` gives
`read_jsonl` and a `download_and_cache_file` that reads a file already in the cache folder
(`--cache-dir`) and otherwise fails with the URL to fetch, since a benchmark does not reach the network.

A `sgl.Runtime` on the embedded default model is the default backend, as in SGLang's test. Each `test_*` function
runs once (`check_answer=False` where the function takes it, as SGLang's backend test passes for small models;
`--check-answers` passes True; `model_path` the served model's folder where it takes that). Prints a table (test, result, seconds, the first line of the failure) and writes a
JSON record (--out). A failure is one of: an answer the 135M model gets wrong (an `assert` on the answer's content),
an input radixserve does not serve (image input), a file that needs the network, or a defect to fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
import types

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)


def install_sglang_names(cache_dir: str) -> None:
    """Make `import sglang`, `sglang.utils` and `sglang.lang.ir` resolve to radixserve's frontend."""
    import radixserve
    import radixserve.frontend as frontend

    def read_jsonl(filename: str):
        with open(filename) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    def download_and_cache_file(url: str, filename: str | None = None) -> str:
        path = os.path.join(cache_dir, filename or url.rsplit("/", 1)[-1])
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is not cached; fetch {url} into {cache_dir} to run this program")
        return path

    from radixserve.runtime.wire.tokenizer_files import load_tokenizer

    utils = types.ModuleType("sglang.utils")
    utils.read_jsonl, utils.download_and_cache_file = read_jsonl, download_and_cache_file
    lang = types.ModuleType("sglang.lang")
    lang.ir = frontend
    tokenizer_utils = types.ModuleType("sglang.srt.hf_transformers_utils")
    tokenizer_utils.get_tokenizer = load_tokenizer
    sys.modules.update({"sglang": radixserve, "sglang.utils": utils, "sglang.lang": lang, "sglang.lang.ir": frontend,
                        "sglang.srt": types.ModuleType("sglang.srt"),
                        "sglang.srt.hf_transformers_utils": tokenizer_utils})


def load_programs(path: str) -> list[tuple[str, object]]:
    spec = importlib.util.spec_from_file_location("sglang_test_programs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(name, fn) for name, fn in vars(module).items() if name.startswith("test_") and callable(fn)]


def run_one(fn, check_answers: bool, model_path: str) -> dict:
    parameters = inspect.signature(fn).parameters
    kwargs = {"check_answer": check_answers} if "check_answer" in parameters else {}
    if "model_path" in parameters:
        kwargs["model_path"] = model_path
    began = time.perf_counter()
    try:
        fn(**kwargs)
        result, detail = "pass", ""
    except Exception as exc:  # every failure is reported, none stops the run
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        result = type(exc).__name__
        detail = f"{str(exc).splitlines()[0][:160] if str(exc) else ''} (line {frame.lineno}: {frame.line})"
    return {"result": result, "seconds": round(time.perf_counter() - began, 1), "detail": detail}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", required=True, help="path to SGLang's python/sglang/test/test_programs.py")
    parser.add_argument("--only", default="", help="comma-separated test names")
    parser.add_argument("--check-answers", action="store_true", help="pass check_answer=True where a test takes it")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/sglang"))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sglang_programs.json"))
    args = parser.parse_args()

    install_sglang_names(args.cache_dir)
    import radixserve as sgl
    from radixserve.runtime.wire.model_files import default_model_path

    programs = load_programs(args.programs)
    if args.only:
        wanted = set(args.only.split(","))
        programs = [(name, fn) for name, fn in programs if name in wanted]
    runtime = sgl.Runtime(log_level="warning")
    sgl.set_default_backend(runtime)
    model_path = runtime.server_args.model_path or default_model_path()
    rows = {}
    try:
        for name, fn in programs:
            rows[name] = run_one(fn, args.check_answers, model_path)
            print(f"{name:<34}{rows[name]['result']:<20}{rows[name]['seconds']:>7.1f}  {rows[name]['detail']}",
                  flush=True)
    finally:
        runtime.shutdown()
    passed = sum(row["result"] == "pass" for row in rows.values())
    print(f"\n{passed} of {len(rows)} passed")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"programs": os.path.abspath(args.programs), "check_answers": args.check_answers, "rows": rows}, f,
                  indent=2)


if __name__ == "__main__":
    main()
