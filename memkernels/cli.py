"""The ``memkernels`` command. Each subcommand registers itself in ``_SUBCOMMANDS``."""
import argparse
import sys


def _add_replay(subparsers):
    parser = subparsers.add_parser(
        "replay",
        help="replay recorded PyTorch memory snapshots: PyTorch's policy vs memkernels vs ideal",
        description="Replay torch.cuda.memory._dump_snapshot pickles through a model of PyTorch's caching "
        "allocator and through memkernels' pool (virtual addresses, no GPU needed), and print peak "
        "reserved / peak requested and device allocations side by side.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="snapshot pickle(s)")
    parser.add_argument("--device", type=int, default=None, help="replay only this device (default: every device)")
    parser.add_argument("--capacity", type=int, default=None, help="device memory in bytes (default: unlimited)")
    parser.add_argument("--repeats", type=int, default=5, help="replays per trace for the ns/op median")
    parser.add_argument(
        "--simulated-device",
        action="store_true",
        help="run memkernels' pool on the simulated CUDA device (cudaMalloc, cudaEvent) instead of plain addresses",
    )
    parser.add_argument(
        "--expandable-segments",
        action="store_true",
        help="both columns with expandable segments (PyTorch's expandable_segments:True, memkernels' VMM pool)",
    )

    def run(args):
        from memkernels.allocator import print_replay_table

        print_replay_table(
            args.traces,
            device=args.device,
            capacity=args.capacity,
            repeats=args.repeats,
            simulated_device=args.simulated_device,
            expandable_segments=args.expandable_segments,
        )
        return 0

    parser.set_defaults(run=run)


_SUBCOMMANDS = [_add_replay]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="memkernels", description="memkernels: measure, then save GPU memory.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"memkernels {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
