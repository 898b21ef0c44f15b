"""`python -m radixserve.launch_server [server flags]`: SGLang's launch command (`python -m sglang.launch_server`)
with radixserve in place of sglang; the same as `radixserve serve`."""

from __future__ import annotations

import sys

from radixserve.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
