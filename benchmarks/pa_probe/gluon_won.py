"""Exit 0 when the Gluon probe's output (argv[1], gluon_decode.py's log) shows the ql 4 decode target
(B=200, 200k) faster on the Gluon kernel than on the shipped one, with its eager and replayed errors within
the bench's 3e-3 (device_run.sh chains the patch's tests and bench on it); else 1. Prints the deciding line."""
import re
import sys

text = open(sys.argv[1]).read()
block = text.split("decode B=200 ctx=200000")[1].split("\nprefill ")[0] if "decode B=200 ctx=200000" in text else ""
best = None
for line in block.splitlines():
    m = re.search(r"gluon NBUF=(\d+).*?\(([\d.]+)% of copy, ([\d.]+)x\), rel err ([\d.e+-]+) \(replayed ([\d.e+-]+)\)",
                  line)
    if m and float(m.group(4)) < 3e-3 and float(m.group(5)) < 3e-3 and (best is None or float(m.group(3)) > best[0]):
        best = (float(m.group(3)), line.strip())
print(best[1] if best else "no correct Gluon row at the 200k target")
sys.exit(0 if best and best[0] > 1.0 else 1)
