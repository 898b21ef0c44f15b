"""The command line: `radixserve serve [server flags]` and `radixserve generate "<prompt>" [flags]`.

    radixserve serve                          # the embedded SmolLM2-135M-Instruct on http://127.0.0.1:30000
    radixserve serve --model-path DIR --port 8000 --api-key KEY
    radixserve generate "Write a haiku about the sea."
    radixserve serve-ray --num-replicas 4     # on a Ray cluster (`ray start --head`): see docs/parallelism.md
    radixserve cache-report --url http://127.0.0.1:30000 --out report.html   # the cache page, as one file
    radixserve check-env                      # the resolved versions, the CPU's instruction sets, the device
    python -m radixserve ...                  # the same
    python -m radixserve.launch_server ...    # = serve, as SGLang's `python -m sglang.launch_server ...`

Server flags come from ServerArgs (SGLang's names); `radixserve serve --help` lists them with defaults.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from radixserve.runtime.import_path import drop_checkout_from_sys_path
from radixserve.runtime.wire.server_args import ServerArgs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="An LLM serving runtime with a radix prefix cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API")
    ServerArgs.add_cli_args(serve)

    generate = commands.add_parser("generate", help="print a completion of one prompt and exit")
    generate.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--raw", action="store_true",
                          help="complete the prompt text as is, without the chat template")
    ServerArgs.add_cli_args(generate)

    serve_ray = commands.add_parser("serve-ray", help="serve on a Ray cluster: N engine replicas behind one ingress "
                                    "(needs radixserve[ray])")
    ServerArgs.add_cli_args(serve_ray)
    from radixserve.runtime.ray_serve.cli import add_cli_args as add_ray_cli_args

    add_ray_cli_args(serve_ray)

    check_env = commands.add_parser("check-env", help="print the resolved versions, the CPU's instruction sets and "
                                    "the device (as `make test` does first)")
    from radixserve.runtime.check_env import add_cli_args as add_check_env_cli_args

    add_check_env_cli_args(check_env)

    report = commands.add_parser("cache-report", help="write a running server's cache page to one HTML file")
    from radixserve.runtime.http.cache_report import add_cli_args

    add_cli_args(report)
    return parser


def _serve_ray(args: argparse.Namespace, server_args: ServerArgs) -> int:
    try:
        from radixserve.runtime.ray_serve.app import run_cli
    except ImportError as error:
        print(f"radixserve: error: serve-ray needs Ray Serve (pip install 'radixserve[ray]'): {error}", file=sys.stderr)
        return 2
    try:
        return run_cli(args, server_args)
    except ValueError as error:
        print(f"radixserve: error: {error}", file=sys.stderr)
        return 2


def _serve(server_args: ServerArgs) -> int:
    if server_args.node_rank > 0:  # a tensor-parallel worker node: only its scheduler ranks, no server
        import logging

        from radixserve.runtime.tp_node import run_worker_node

        logging.basicConfig(level=server_args.log_level.upper(),
                            format="%(asctime)s [tp-node] %(levelname)s %(name)s: %(message)s")
        return run_worker_node(server_args)
    from radixserve.runtime.http.server import launch_server

    launch_server(server_args)
    return 0


def _generate(args: argparse.Namespace, server_args: ServerArgs) -> int:
    from radixserve.runtime.engine import Engine

    with Engine(**server_args.to_dict()) as engine:
        if args.raw:
            input_ids = engine.tokenizer.encode(args.prompt)
        else:
            input_ids = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True,
                return_dict=True)["input_ids"]
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
        printed = 0  # each chunk holds the whole text so far (unless --incremental-streaming-output)
        for chunk in engine.generate(input_ids=list(input_ids), sampling_params=params, stream=True):
            new_text = chunk["text"] if server_args.incremental_streaming_output else chunk["text"][printed:]
            printed += len(new_text)
            sys.stdout.write(new_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    drop_checkout_from_sys_path()  # before anything imports a dependency that imports `kernels` by its bare name
    args = _parser().parse_args(argv)
    if args.command == "check-env":
        from radixserve.runtime.check_env import run as check_env

        return check_env(args)
    if args.command == "cache-report":
        from radixserve.runtime.http.cache_report import run

        return run(args)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as error:
        print(f"radixserve: error: {error}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(server_args)
    if args.command == "serve-ray":
        return _serve_ray(args, server_args)
    return _generate(args, server_args)


if __name__ == "__main__":
    sys.exit(main())
