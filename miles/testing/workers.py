"""Stand-in Ray workers for supervisor tests (in the package, so Ray workers can import them)."""

from __future__ import annotations

import time


class FailOrHang:
    """`call("fail")` raises; `call("hang")` never returns, as a rank in a collective whose peer is gone;
    `call("finish")` returns at once; `call("slow")` returns after 4 s."""

    def call(self, method: str):
        if method == "fail":
            raise RuntimeError("this rank failed first")
        if method == "finish":
            return "done"
        if method == "slow":
            time.sleep(4)
            return "slow"
        while True:
            time.sleep(0.1)

    def pid(self) -> int:
        import os

        return os.getpid()

    def ping(self) -> bool:
        return True

    def stacks(self) -> str:
        from miles.cluster.supervisor import python_stacks

        return python_stacks()
