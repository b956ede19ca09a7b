"""python -m keel.rank_table --npu_count 4 --topology hccs_full_mesh

cann-recipes-train's generate_rank_table, as the article spells it: the options of
`keel rank-table` with underscores or dashes (docs/distributed.md)."""
import os
import sys

from ._command import keel_binary


def _option(arg):
    """--npu_count=4 -> --npu-count=4: the option's name only, never its value."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def main(argv=None):
    args = [_option(a) for a in (sys.argv[1:] if argv is None else argv)]
    binary = keel_binary()
    os.execv(binary, [binary, "rank-table"] + args)


if __name__ == "__main__":
    main()
