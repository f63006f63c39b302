"""tests/kernels/sass.py, the SASS reader that the Mosaic GPU kernels' compile check runs: on listings
in nvdisasm's form, the scores' wgmma whose Q fragments a loop overwrites is found (the fault of
mosaic_own's forward at head size 64 on jaxlib 0.11.2), and fragments loaded in each step, or left
alone, pass."""

from tests.kernels import sass


def _listing(body: str) -> str:
  """nvdisasm's layout: a kernel's section, labels, and instructions at addresses."""
  lines = ["\t.section\t.text.k,\"ax\",@progbits", ".text.k:"]
  address = 0
  for line in body.strip().splitlines():
    line = line.strip()
    if not line:
      continue
    if line.endswith(":"):
      lines.append(line)
    else:
      lines.append(f"        /*{address:04x}*/                   {line} ;")
      address += 16
  return "\n".join(lines)


HEAD = """
LDSM.16.M88.4 R88, [R11]
IMAD.MOV.U32 R20, RZ, RZ, RZ
.L_x_1:
SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R21
@!P1 BRA `(.L_x_9)
"""
SCORES = """
WARPGROUP.ARRIVE
HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR20], RZ, !UPT, gsb0
WARPGROUP.DEPBAR.LE gsb0, 0x0
"""
TAIL = """
F2FP.BF16.F32.PACK_AB R{p}, R25, R24
HGMMA.64x64x16.F32.BF16 R56, R{p}, gdesc[UR16].tnspB, R56, gsb0
WARPGROUP.DEPBAR.LE gsb0, 0x0
IADD3 R20, R20, 0x1, RZ
ISETP.NE.AND P1, PT, R20, 0x8, PT
@P1 BRA `(.L_x_1)
EXIT
.L_x_9:
SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R21
@!P1 BRA `(.L_x_9)
BRA `(.L_x_1)
"""


def _clobbered(body: str):
  (instructions, labels), = sass.kernels(_listing(body)).values()
  return sass.clobbered_register_operands(instructions, labels)


def test_weights_packed_into_the_queries_registers_are_found():
  found = _clobbered(HEAD + SCORES + TAIL.format(p=90))
  assert {register for _, register, _ in found} == {90}
  (hgmma, _, writer), = found
  assert hgmma == 5 and writer == 7  # the scores' HGMMA; the F2FP after it in the loop


def test_weights_in_their_own_registers_or_queries_loaded_each_step_pass():
  assert _clobbered(HEAD + SCORES + TAIL.format(p=120)) == []  # P beside Q
  reloaded = HEAD + "LDSM.16.M88.4 R88, [R11]\n" + SCORES + TAIL.format(p=90)  # Q reloaded in the step
  assert _clobbered(reloaded) == []


def test_written_registers_span_vectors_accumulators_and_shuffles():
  (instructions, _), = sass.kernels(_listing("""
LDSM.16.M88.4 R88, [R11]
LDS.128 R4, [R2]
IMAD.WIDE.U32 R8, R3, 0x4, R6
HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR20].tnspB, R24
SHFL.BFLY PT, R57, R56, 0x2, 0x1f
FSETP.GT.AND P1, PT, R90, R91, PT
STSM.16.M88.4 [R11], R16
""")).values()
  written = [ins.written() for ins in instructions]
  assert written[:4] == [set(range(88, 92)), set(range(4, 8)), {8, 9}, set(range(24, 88))]
  assert written[4:] == [{57}, set(), set()]
  assert instructions[3].register_a() == set(range(88, 92))
