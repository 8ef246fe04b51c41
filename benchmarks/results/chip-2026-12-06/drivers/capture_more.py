"""Profile captures of calibrate.py's programs: xplane + compiled HLO text."""
import pathlib, sys, gzip, shutil
HERE = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(HERE))
import calibrate, chip_captures
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
for name in sys.argv[2:]:
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
  except Exception as e:
    print(name, "FAILED", type(e).__name__, str(e)[:400], flush=True)
