"""Attribute every kernel of an Nsight Compute result to layer, op and direction,
with what ncu measured.

    bench/ncu.sh  # one training step under ncu, NVTX-filtered, then this
    gpt2np ncu step.csv [--records builtin/profile.json] [--device NAME] [--csv OUT] [--json OUT]
    gpt2np ncu step.ncu-rep ...  # through the ncu-report package (pip install ncu-report)

Inputs:
  * `ncu --csv` exports, both layouts ncu writes: the details page (one row per kernel and metric:
    "ID", ..., "Kernel Name", ..., "Block Size", "Grid Size", ..., "Metric Name", "Metric Unit",
    "Metric Value") and the raw page (`--page raw`: one row per kernel, one column per metric, a row
    of units under the header). Lines ncu prints before the table (==PROF== ...) are skipped;
    numbers may carry thousands separators; "n/a" is unknown.
  * `.ncu-rep` reports, read with NVIDIA's ncu_report module: metrics by name, and each kernel's
    NVTX push/pop stack (IAction.nvtx_state()).

Attribution, first that applies per kernel:
  1. `--records profile.json` (gpt2np's own profile of the same configuration and step): ncu's
     kernels in launch order are matched to the profile's kernel records in order (GEMM to GEMM,
     every other kernel by name); a matched kernel takes the record's step, direction, layer, op,
     module and FLOPs/bytes of the op's cost, and the report compares the two times (the built-in
     times against ncu's).
  2. the NVTX stack (the .ncu-rep's; a CSV column whose name contains "NVTX", ranges separated by "
     > ", as a best effort: ncu's CSV pages do not document one) -> nsys.parse_stack's
     rules (ours and llm.c's).
  3. the kernel's name (llm.c's kernels, NCCL: nsys.kernel_op); else "other".

Per kernel it reports time (gpu__time_duration), achieved FLOP/s (fp32 FLOPs from the SASS counters
fadd + fmul + 2 ffma when collected, else the op's cost), DRAM bandwidth (dram__bytes), achieved
occupancy (sm__warps_active % of peak), ncu's SM and memory throughput (% of peak) and % of the
roofline (the roofline floor max(FLOPs/peak, bytes/bandwidth) over the time), plus per-op totals.
"""
import csv
import io
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from gpt2np.profiling import nsys
from gpt2np.profiling.render import report
from gpt2np.profiling.render.report import KernelRecord, format_table
from gpt2np.profiling.render.views import floor_ns

TIME = "gpu__time_duration.sum"
DRAM = "dram__bytes.sum"
DRAM_PARTS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
FADD, FMUL, FFMA = (f"sm__sass_thread_inst_executed_op_{op}_pred_on.sum"
                    for op in ("fadd", "fmul", "ffma"))
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
MEM_PCT = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"
GRID, BLOCK = "launch__grid_size", "launch__block_size"

# unit -> factor to the base unit (ns for time, bytes for sizes, 1 for the rest)
TIME_UNITS = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
              "second": 1e9, "s": 1e9}
BYTE_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12, "kib": 1024,
              "mib": 1024 ** 2, "gib": 1024 ** 3}
UNITS = {**TIME_UNITS, **BYTE_UNITS}
# the metrics the report computes with: a value must be a finite number >= 0 in a unit of its
# kind ("" = base unit)
CHECKED = {TIME: ("a time", TIME_UNITS), DRAM: ("a size", BYTE_UNITS),
           **dict.fromkeys(DRAM_PARTS, ("a size", BYTE_UNITS)),
           **dict.fromkeys((FADD, FMUL, FFMA, GRID, BLOCK, OCCUPANCY, SM_PCT, MEM_PCT),
                           ("a count", None))}
HEADER_START = '"ID"'


class NcuReportError(ValueError):
    """An export or report that cannot be read; the message names the file and the problem."""


@dataclass
class NcuKernel:
    """One profiled kernel: ncu's id, name, grid and block as ncu prints them, its metrics in base
    units (ns, bytes, %) and its NVTX stack (names, outermost first; empty when unknown)."""
    id: int
    name: str
    grid: str
    block: str
    device: str = ""
    metrics: Dict[str, Optional[float]] = field(default_factory=dict)
    nvtx: tuple = ()

    def metric(self, name) -> Optional[float]:
        return self.metrics.get(name)

    @property
    def time_ns(self) -> Optional[float]:
        return self.metric(TIME)

    @property
    def dram_bytes(self) -> Optional[float]:
        if self.metric(DRAM) is not None:
            return self.metric(DRAM)
        parts = [self.metric(p) for p in DRAM_PARTS]
        return sum(parts) if all(p is not None for p in parts) else None

    @property
    def fp32_flops(self) -> Optional[float]:
        counts = [self.metric(m) for m in (FADD, FMUL, FFMA)]
        if all(c is None for c in counts):
            return None
        fadd, fmul, ffma = (c or 0 for c in counts)
        return fadd + fmul + 2 * ffma


# ---------------------------------------------------------------------------------------------
# reading

def number(text, unit: str = "") -> Optional[float]:
    """'1,215,000,000.00' -> 1.215e9 (times the unit's factor); '', 'n/a' -> None."""
    text = str(text).strip().replace(",", "")
    if text in ("", "n/a", "N/A", "nan"):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value * UNITS.get(unit.strip().lower(), 1)


def checked(where: str, name: str, value, unit: str = "") -> Optional[float]:
    """A metric's value in its base unit (None: unknown). For the metrics the report uses (CHECKED)
    a value that is not a number, negative, infinite or in a unit of the wrong kind (a time in
    'parsecs') raises NcuReportError naming `where` (file and line) and the metric; other metrics
    are read as best they can be."""
    if value is None:
        return None
    text = value if isinstance(value, (int, float)) else str(value).strip().replace(",", "")
    if text in ("", "n/a", "N/A", "nan"):
        return None
    if name not in CHECKED:
        return number(text, unit)
    kind, units = CHECKED[name]
    try:
        x = float(text)
    except (TypeError, ValueError):
        raise NcuReportError(f"{where}: metric {name}: {str(value)!r} is not a number") from None
    if math.isnan(x):
        return None
    if not math.isfinite(x) or x < 0:
        raise NcuReportError(f"{where}: metric {name}: {value}: must be a finite number >= 0")
    key = str(unit or "").strip().lower()
    if units is not None:
        if key and key not in units:
            raise NcuReportError(f"{where}: metric {name}: unit {str(unit).strip()!r} is not "
                                 f"{kind} unit (expected one of {', '.join(sorted(units))})")
        return x * units.get(key, 1)
    return x * UNITS.get(key, 1)


def _require_times(path: str, kernels: List["NcuKernel"], what: str) -> None:
    """NcuReportError unless there are kernels and some of them have a time (else every
    time would show 0)."""
    if not kernels:
        raise NcuReportError(f"{path}: no profiled kernels ({what})")
    if all(k.time_ns is None for k in kernels):
        raise NcuReportError(f"{path}: no {TIME} values (the kernels' times); profile with `ncu "
                             f"--metrics {TIME}` "
                             f"or a section that collects it (--section SpeedOfLight)")


def _dims(text: str) -> str:
    """'(256, 1, 1)' -> '(256,1,1)'."""
    return re.sub(r"\s+", "", text or "")


def _nvtx_columns(header: List[str]) -> List[str]:
    return [h for h in header if "nvtx" in h.lower()]


def _stack(text: str) -> tuple:
    return tuple(part.strip() for part in re.split(r"\s*>\s*", text or "") if part.strip())


def read_csv(path: str) -> List[NcuKernel]:
    """Kernels of an `ncu --csv` export (details page or --page raw)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise NcuReportError(f"{path}: cannot read ({e.strerror or e})") from None
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER_START)), None)
    if start is None:
        raise NcuReportError(f"{path}: no ncu CSV table (no header line starting with "
                             "\"ID\"); export with "
                             f"`ncu --import REPORT --csv --page raw` or profile with `ncu --csv`")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    # (1-based line in the file, row)
    numbered = [(start + reader.line_num, row) for row in reader]
    header, rows = numbered[0][1], [(n, r) for n, r in numbered[1:] if r]
    col = {name: i for i, name in enumerate(header)}
    for need in ("Kernel Name", "ID"):
        if need not in col:
            raise NcuReportError(f"{path}: the CSV has no {need!r} column (not an ncu export?)")
    nvtx_cols = _nvtx_columns(header)

    def cell(row, name):
        i = col.get(name)
        return row[i] if i is not None and i < len(row) else ""

    kernels: Dict[int, NcuKernel] = {}
    if "Metric Name" in col and "Metric Value" in col:           # details page: one row per metric
        for line, row in rows:
            kid = number(cell(row, "ID"))
            if kid is None:
                continue
            k = kernels.get(int(kid))
            if k is None:
                k = kernels[int(kid)] = NcuKernel(
                    int(kid), cell(row, "Kernel Name"), _dims(cell(row, "Grid Size")),
                    _dims(cell(row, "Block Size")), cell(row, "Device"),
                    nvtx=next((_stack(cell(row, c)) for c in nvtx_cols if cell(row, c)), ()))
            name = cell(row, "Metric Name")
            k.metrics[name] = checked(f"{path}: line {line} (kernel {int(kid)})", name,
                                      cell(row, "Metric Value"), cell(row, "Metric Unit"))
    else:                                                          # raw page: one column per metric
        units = {}
        if rows and not cell(rows[0][1], "ID").strip():            # the units row
            units = {name: rows[0][1][i] for name, i in col.items() if i < len(rows[0][1])}
            rows = rows[1:]
        fixed = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
                 "Stream", "Block Size", "Grid Size", "Device", "CC"} | set(nvtx_cols)
        if TIME not in col:
            raise NcuReportError(f"{path}: the CSV has no {TIME!r} column (the kernels' times); "
                                 f"profile with `ncu --metrics {TIME}` or a section that collects "
                                 "it (--section SpeedOfLight)")
        for line, row in rows:
            kid = number(cell(row, "ID"))
            if kid is None:
                continue
            where = f"{path}: line {line} (kernel {int(kid)})"
            metrics = {name: checked(where, name, cell(row, name), units.get(name, ""))
                       for name in header
                       if name not in fixed}
            kernels[int(kid)] = NcuKernel(
                int(kid), cell(row, "Kernel Name"), _dims(cell(row, "Grid Size")),
                _dims(cell(row, "Block Size")), cell(row, "Device"), metrics,
                next((_stack(cell(row, c)) for c in nvtx_cols if cell(row, c)), ()))
    if not kernels:
        raise NcuReportError(f"{path}: the ncu table has no kernel rows")
    out = [kernels[i] for i in sorted(kernels)]
    _require_times(path, out, "the ncu table has no kernel rows")
    return out


def read_rep(path: str, ncu_report=None) -> List[NcuKernel]:
    """Kernels of an .ncu-rep through NVIDIA's ncu_report module (ncu_report: the
    module, for tests)."""
    if ncu_report is None:
        try:
            import ncu_report
        except ImportError:
            raise NcuReportError(f"{path}: reading .ncu-rep needs NVIDIA's ncu_report module (pip "
                                 f"install ncu-report), or export a CSV: ncu --import {path} "
                                 "--csv --page raw") from None
    try:
        ctx = ncu_report.load_report(path)
    except (FileNotFoundError, OSError, RuntimeError) as e:
        raise NcuReportError(f"{path}: cannot load the report ({e})") from None
    kernels = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            action = rng.action_by_idx(a)
            metrics = {}
            where = f"{path}: range {r}, kernel {a} ({action.name()})"
            for name in action.metric_names():
                m = action.metric_by_name(name)
                value = m.value() if m is not None and m.has_value() else None
                if name in CHECKED:
                    metrics[name] = checked(where, name, value,
                                            "" if value is None else str(m.unit()))
                else:
                    metrics[name] = (value * UNITS.get(str(m.unit()).lower(), 1)
                                     if isinstance(value, (int, float))
                                     and not isinstance(value, bool) else value)
            stack = ()
            state = action.nvtx_state()
            if state is not None:
                for domain_id in state.domains():
                    names = tuple(state.domain_by_id(domain_id).push_pop_ranges())
                    if names:
                        stack = names
                        break
            grid, block = metrics.get(GRID), metrics.get(BLOCK)
            kernels.append(NcuKernel(len(kernels), action.name(),
                                     "" if grid is None else f"({int(grid)})",
                                     "" if block is None else f"({int(block)})", "",
                                     metrics, stack))
    _require_times(path, kernels, "not an Nsight Compute report, or one that profiled nothing")
    return kernels


def read(path: str) -> List[NcuKernel]:
    if os.path.isdir(path):
        raise NcuReportError(f"{path}: is a folder; expected an `ncu --csv` export or "
                             "an .ncu-rep report")
    if not os.path.isfile(path):
        raise NcuReportError(f"{path}: no such file")
    return read_rep(path) if path.endswith((".ncu-rep", ".ncu-repz")) else read_csv(path)


# ---------------------------------------------------------------------------------------------
# attribution

def align(kernels: List[NcuKernel], records: List[KernelRecord]) -> Dict[int, KernelRecord]:
    """{ncu kernel position: gpt2np record}: both in launch order, a GEMM matches a GEMM, any other
    kernel a record of the same name; on a mismatch the walk skips ncu's kernel (a
    library's extra kernel)."""
    recs = [r for r in sorted(records, key=lambda r: r.idx) if r.kind == "kernel"]
    out, j = {}, 0
    for i, k in enumerate(kernels):
        if j >= len(recs):
            break
        r = recs[j]
        probe = KernelRecord(0, None, "", None, "", "", "", k.name, 0, 0)
        if (r.is_gemm and probe.is_gemm) or r.kernel == k.name or k.name.startswith(r.kernel + "("):
            out[i] = r
            j += 1
    return out


def attribute(kernels: List[NcuKernel], records: Optional[List[KernelRecord]] = None):
    """(records for the ncu kernels, {position: matched gpt2np record})."""
    matched = align(kernels, records) if records else {}
    fake = []
    for i, k in enumerate(kernels):
        stack = tuple(nsys.NvtxRange(-1, name, 0, 0, 0, "PushPop") for name in k.nvtx)
        fake.append(nsys.Kernel(i, i + 1, i, k.name, "", i, i, 0, stack))
    _number_instances(fake)
    by_stack = nsys.to_records(fake)
    out = []
    for i, (k, guess) in enumerate(zip(kernels, by_stack)):
        r = matched.get(i)
        time = k.time_ns
        flops = k.fp32_flops
        dram = k.dram_bytes
        if r is not None:
            src = dict(step=r.step, direction=r.direction, layer=r.layer, op=r.op, module=r.module,
                       params=r.params, range_stack=r.range_stack)
            if flops is None or (r.is_gemm and r.flops):
                # tensor-core GEMMs do not count in the fp32 SASS counters
                flops = r.flops
            if dram is None:
                dram = r.bytes
        else:
            src = dict(step=guess.step, direction=guess.direction, layer=guess.layer, op=guess.op,
                       module=guess.module, params="", range_stack=guess.range_stack)
        out.append(KernelRecord(idx=i, kernel=k.name, start_ns=0, duration_ns=int(time or 0),
                                flops=int(flops or 0),
                                bytes=int(dram or 0), grid=k.grid, block=k.block, **src))
    return out, matched


def _number_instances(kernels) -> None:
    """Give the NVTX ranges of consecutive kernels that share a stack prefix one instance id (ncu
    reports names, not instances): what nsys.to_records counts positions with."""
    current: List = []
    counter = 0
    for k in kernels:
        new = []
        for d, rng in enumerate(k.stack):
            if d < len(current) and current[d][0] == rng.name and all(
                    new[e] is current[e][1] for e in range(d)):
                rng.row = current[d][1].row
                new.append(current[d][1])
            else:
                counter += 1
                rng.row = counter
                new.append(rng)
        current = [(r.name, r) for r in new]


# ---------------------------------------------------------------------------------------------
# the report

def kernel_rows(kernels, records, matched, roof):
    """One row of the kernel table (COLUMNS) per ncu kernel, with its attributed record and,
    where --records matched it, the built-in profile's time over ncu's."""
    rows = []
    for i, (k, r) in enumerate(zip(kernels, records)):
        t = r.duration_ns
        floor = floor_ns(r, roof)
        built_in = matched.get(i)

        def pct(m, k=k):
            v = k.metric(m)
            return "-" if v is None else f"{v:.1f}"

        rows.append([i, r.direction, "-" if r.layer_index is None else r.layer_index, r.op or "-",
                     r.module or "-", report.clip(k.name, 40), k.grid or "-", k.block or "-",
                     report.us(t), report.or_dash(r.gflops_per_s), report.or_dash(r.gbytes_per_s),
                     pct(OCCUPANCY), pct(SM_PCT), pct(MEM_PCT),
                     "-" if floor is None or t <= 0 else f"{100.0 * floor / t:.1f}",
                     "-" if built_in is None or t <= 0 else f"{built_in.duration_ns / t:.2f}"])
    return rows


COLUMNS = [("idx", "r"), ("dir", "l"), ("layer", "r"), ("op", "l"), ("module", "l"),
           ("kernel", "l"), ("grid", "l"), ("block", "l"), ("time (us)", "r"), ("GFLOP/s", "r"),
           ("GB/s", "r"), ("occupancy %", "r"), ("SM %", "r"),
           ("mem %", "r"), ("% roofline", "r"), ("built-in/ncu", "r")]


def agreement(kernels, matched) -> Optional[dict]:
    """How the built-in profile's kernel times compare with ncu's: median ratio and the
    share within 10%."""
    ratios = [matched[i].duration_ns / k.time_ns for i, k in enumerate(kernels)
              if i in matched and k.time_ns and matched[i].duration_ns > 0]
    if not ratios:
        return None
    within = sum(abs(x - 1) <= 0.10 for x in ratios) / len(ratios)
    total = (sum(matched[i].duration_ns for i in matched)
             / (sum(kernels[i].time_ns or 0 for i in matched) or 1))
    return {"kernels": len(ratios), "median_ratio": statistics.median(ratios),
            "within_10pct": within, "total_ratio": total}


def render(path, kernels, records, matched, roof, records_path: Optional[str] = None) -> str:
    """The kernel table, per-op totals and how the kernels were attributed: the agreement with the
    --records profile (records_path), or a note when nothing matched it."""
    parts = [format_table(COLUMNS, kernel_rows(kernels, records, matched, roof),
                          f"Nsight Compute: {len(kernels)} kernels of {os.path.basename(path)}"
                          + (f" against {roof.device}" if roof else "")),
             report.op_table(records, roof)]
    agree = agreement(kernels, matched)
    if agree:
        parts.append(f"built-in vs ncu kernel times: {agree['kernels']} kernels matched, median "
                     f"ratio {agree['median_ratio']:.3f}, {100 * agree['within_10pct']:.0f}% "
                     f"within 10%, step total ratio {agree['total_ratio']:.3f}")
    elif not matched:
        # a profile of another configuration, step or device matches nothing: said, as
        # align skips any mismatch
        how = "their NVTX stacks" if any(k.nvtx for k in kernels) else "name only"
        if records_path:
            parts.append(f"--records {records_path}: matched none of the {len(kernels)} "
                         "kernels (a profile of "
                         f"another configuration or device?): kernels attributed by {how}")
        elif how == "name only":
            parts.append("no NVTX stacks and no --records profile: kernels attributed by name only")
    return "\n\n".join(parts) + "\n"
