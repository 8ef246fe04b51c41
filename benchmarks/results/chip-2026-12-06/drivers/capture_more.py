"""Profile captures of calibrate.py's programs: xplane + compiled HLO text.

Run on the device from the repository root:
python .chip/capture_more.py DIR NAME [NAME ...]
"""
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import calibrate  # noqa: E402
import chip_captures  # noqa: E402


def main(out: pathlib.Path, names: list[str]) -> None:
  out.mkdir(parents=True, exist_ok=True)
  for name in names:
    try:
      jitted, args = calibrate.PROGRAMS[name][1]()
      where = out / name
      text = chip_captures.capture(jitted, args, where, 2)
      (out / f"{name}.hlo.txt").write_text(text)
      pbs = list(where.rglob("*.xplane.pb"))
      for pb in pbs:
        shutil.copy(pb, out / f"{name}.xplane.pb")
      shutil.rmtree(where)
      print(name, "captured", [p.stat().st_size for p in pbs], flush=True)
    except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
      print(name, "FAILED", type(e).__name__, str(e)[:400], flush=True)


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), sys.argv[2:])
