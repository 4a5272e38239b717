"""Job progress on a terminal, for the commands that run jobs in-process."""


def printer(stream):
    """A progress callback (phase, done, total) writing each phase once per tenth of the way."""
    shown = set()

    def report(phase: str, done: int, total: int) -> None:
        step = (phase, done * 10 // total if total else 0)
        if step not in shown:
            shown.add(step)
            stream.write(f"  {phase} {done * 100 // total}%" if total else f"  {phase}")

    return report
