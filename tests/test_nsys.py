"""gpt2np.profiling.nsys: kernels of a (hand-built) Nsight Systems SQLite export
attributed to NVTX ranges."""
import errno
import json
import os
import re
import sqlite3

import pytest

from gpt2np.cli import nsys as nsys_cli
from gpt2np.cli import report as report_cli
from gpt2np.profiling import nsys
from gpt2np.profiling.render import report

# Table layouts as `nsys export -t sqlite` writes them (the columns we read, plus some we do not).
SCHEMA = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE TARGET_INFO_GPU (vmId INTEGER NOT NULL, id INTEGER NOT NULL, name TEXT, busLocation
    TEXT, totalMemory INTEGER, smCount INTEGER, computeMajor INTEGER, computeMinor INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId
    INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
    textId INTEGER REFERENCES StringIds (id), domainId INTEGER, uint64Value INTEGER, int64Value
    INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, floatValue REAL, jsonTextId
    INTEGER, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass
    INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL REFERENCES
    StringIds (id), returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId
    INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER,
    globalPid INTEGER, demangledName INTEGER NOT NULL REFERENCES StringIds (id), shortName INTEGER
    NOT NULL REFERENCES StringIds (id), mangledName INTEGER, launchType INTEGER, cacheConfig
    INTEGER, registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT NULL,
    gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT
    NULL, staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL,
    localMemoryPerThread INTEGER NOT NULL, localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT
    NULL, sharedMemoryExecuted INTEGER, graphNodeId INTEGER, sharedMemoryLimitConfig INTEGER);
"""
# copies and memsets, and the copy-kind enum (nsys 2024.6, export schema 3.16)
COPY_SCHEMA = """
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId
    INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL,
    deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER, srcDeviceId INTEGER, srcContextId
    INTEGER, dstDeviceId INTEGER, dstContextId INTEGER, migrationCause INTEGER, graphNodeId INTEGER,
    virtualAddress INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId
    INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, value INTEGER NOT NULL, bytes INTEGER NOT NULL,
    graphNodeId INTEGER, memKind INTEGER);
"""
ENUM_SCHEMA = """
CREATE TABLE ENUM_CUDA_MEMCPY_OPER (id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT);
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(0,'CUDA_MEMCPY_KIND_UNKNOWN','Unknown');
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(1,'CUDA_MEMCPY_KIND_HTOD','Host-to-Device');
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(2,'CUDA_MEMCPY_KIND_DTOH','Device-to-Host');
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(8,'CUDA_MEMCPY_KIND_DTOD','Device-to-Device');
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(9,'CUDA_MEMCPY_KIND_HTOH','Host-to-Host');
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(10,'CUDA_MEMCPY_KIND_PTOP','Peer-to-Peer');
INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES(11,'CUDA_MEMCPY_KIND_UVM_HTOD','Unified Host-to-Device');
"""
HTOD, DTOH, DTOD = 1, 2, 8

PID, OTHER_PID = 4242, 777
MAIN = (PID << 24) | 4242          # globalTid of the main thread
LOADER = (PID << 24) | 4250        # a second thread of the same process
OTHER = (OTHER_PID << 24) | 777    # a thread of another process


class Export:
    """Builds an export: strings, NVTX ranges, launch calls and kernels."""

    def __init__(self):
        self.strings = {}
        self.nvtx, self.runtime, self.kernels = [], [], []
        self.memcpy, self.memset = [], []
        self.copy_tables, self.copy_enum = False, True
        self.corr = 100

    def sid(self, text):
        return self.strings.setdefault(text, len(self.strings) + 1)

    def range(self, name, start, end, tid=MAIN, registered=True, event_type=59, domain=0,
              end_tid=None):
        text, text_id = (None, self.sid(name)) if registered else (name, None)
        self.nvtx.append((start, end, event_type, text, tid, end_tid, text_id, domain))

    def domain(self, domain_id, name, tid=MAIN):
        self.nvtx.append((0, None, 75, name, tid, None, None, domain_id))

    def launch(self, kernel, at, duration=300, tid=MAIN, short=None, grid=(4, 1, 1),
               block=(256, 1, 1), with_launch=True, gpu_start=None):
        """A launch call at `at` (lasting 20 ns) of a kernel that runs `duration` ns."""
        self.corr += 1
        if with_launch:
            self.runtime.append((at, at + 20, 1, tid, self.corr, self.sid("cudaLaunchKernel"), 0))
        start = gpu_start if gpu_start is not None else at + 50_000
        self.kernels.append((start, start + duration, 0, 1, 7, self.corr, (tid >> 24) << 24,
                             self.sid(kernel), self.sid(short or kernel), 32, *grid, *block))
        return self.corr

    def copy(self, kind, nbytes, at, duration=1_000, tid=MAIN, api="cudaMemcpyAsync_v3020",
             memset=False):
        """A cudaMemcpyAsync (copyKind `kind`) or cudaMemsetAsync call at `at` and the copy/memset
        it issues, which starts 50 us later and lasts `duration` ns (real exports name API calls
        with a version suffix)."""
        self.corr += 1
        self.copy_tables = True
        self.runtime.append((at, at + 20, 1, tid, self.corr, self.sid(api), 0))
        start = at + 50_000
        if memset:
            self.memset.append((start, start + duration, 0, 1, 7, self.corr, (tid >> 24) << 24, 0,
                                nbytes))
        else:
            self.memcpy.append((start, start + duration, 0, 1, 7, self.corr, (tid >> 24) << 24,
                                nbytes, kind))
        return self.corr

    def write(self, path):
        con = sqlite3.connect(path)
        con.executescript(SCHEMA)
        if self.copy_tables:
            con.executescript(COPY_SCHEMA + (ENUM_SCHEMA if self.copy_enum else ""))
            con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, "
                            "contextId, streamId, correlationId, globalPid, bytes, copyKind) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            self.memcpy)
            con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET (start, end, deviceId, "
                            "contextId, streamId, correlationId, globalPid, value, bytes) VALUES "
                            "(?, ?, ?, ?, ?, ?, ?, ?, ?)", self.memset)
        con.executemany("INSERT INTO StringIds VALUES (?, ?)",
                        [(i, s) for s, i in self.strings.items()])
        con.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 0, 'NVIDIA H100 80GB HBM3', "
                    "'0000:01:00.0', 0, 132, 9, 0)")
        con.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, "
                        "endGlobalTid, textId, "
                        "domainId) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", self.nvtx)
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME (start, end, eventClass, "
                        "globalTid, correlationId, "
                        "nameId, returnValue) VALUES (?, ?, ?, ?, ?, ?, ?)", self.runtime)
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, "
                        "streamId, correlationId, globalPid, demangledName, shortName, "
                        "registersPerThread, gridX, gridY, "
                        "gridZ, blockX, blockY, blockZ, staticSharedMemory, dynamicSharedMemory, "
                        "localMemoryPerThread, localMemoryTotal, gridId) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, 0, 0, 0)",
                        self.kernels)
        con.commit()
        con.close()
        return str(path)


GEMM = "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(Params)"


def training_step_export():
    """One training step of a 1-layer model on the main thread, plus the awkward cases."""
    e = Export()
    e.domain(5, "gpt2np")
    e.range("epoch", 900, 40_000, event_type=60, domain=5)           # start/end range, named domain
    e.launch("warmup_kernel", 500)                                    # before any range
    e.range("Train step 1", 1_000, 30_000)
    e.range("gpt2_forward", 1_100, 9_000)
    e.range("encoder_forward", 1_200, 1_300, registered=False)        # plain-text message
    e.launch("encoder_forward_kernel", 1_250)
    e.range("Layer 0", 1_400, 8_000)
    e.range("layernorm_forward", 1_500, 1_600)
    e.launch("layernorm_forward_kernel", 1_550)
    e.range("matmul_forward", 1_700, 1_800)
    e.launch(GEMM, 1_750, short="Kernel2")
    e.range("attention_forward", 1_900, 2_100)
    e.launch("permute_kernel", 1_950)
    e.launch("softmax_forward_kernel", 2_000)
    e.range("matmul_forward", 2_200, 2_300)
    e.launch(GEMM, 2_250, short="Kernel2")
    e.range("layernorm_forward", 8_100, 8_200)                        # ln_f: outside the layers
    e.launch("layernorm_forward_kernel", 8_150)
    e.range("gpt2_backward", 9_100, 15_000)
    e.range("Layer 0", 9_200, 14_000)
    e.range("matmul_backward", 9_300, 9_600)
    e.launch(GEMM, 9_350, short="Kernel2")
    e.launch(GEMM, 9_400, short="Kernel2")
    e.launch("matmul_backward_bias_kernel", 9_450)
    e.range("matmul_backward", 9_700, 9_800)
    e.launch(GEMM, 9_750, short="Kernel2")
    e.launch("straddling_kernel", 13_990)                             # call ends after Layer 0 ends
    e.range("gpt2_update", 15_100, 19_000)
    e.range("adamw", 15_200, 15_300)
    e.launch("adamw_kernel", 15_250)
    # a second thread of the process, with its own ranges overlapping the main thread's in time
    e.range("data_loader", 1_000, 30_000, tid=LOADER)
    e.range("Layer 7", 1_450, 1_560, tid=LOADER)
    e.launch("loader_kernel", 1_500, tid=LOADER)
    # another process reuses a correlation id of ours: it must not be joined to our kernel
    e.runtime.append((1_760, 1_780, 1, OTHER, e.corr - 1, e.sid("cudaLaunchKernel"), 0))
    # a kernel with no launch record at all
    e.corr += 1
    e.kernels.append((99_000, 99_100, 0, 1, 7, e.corr, PID << 24, e.sid("orphan_kernel"),
                      e.sid("orphan_kernel"), 32, 1, 1, 1, 32, 1, 1))
    return e


@pytest.fixture
def step_db(tmp_path):
    return training_step_export().write(tmp_path / "prof.sqlite")


def brief(records):
    return [(r.kernel if r.kernel != GEMM else "GEMM", r.step, r.direction, r.layer, r.op, r.module,
             r.range_stack) for r in records]


def test_attribution_is_exact(step_db):
    records, ranges, device, profile = nsys.read_report(step_db)
    S, E = "Train step 1", "gpt2np:epoch"
    assert device == "NVIDIA H100 80GB HBM3"
    assert brief(records) == [
        ("warmup_kernel", None, "other", None, "", "", ()),
        ("encoder_forward_kernel", 1, "fprop", None, "encoder_forward", "wte",
         (E, S, "gpt2_forward", "encoder_forward")),
        ("loader_kernel", None, "other", 7, "", "h.7", ("data_loader", "Layer 7")),
        ("layernorm_forward_kernel", 1, "fprop", 0, "layernorm_forward", "h.0.ln_1",
         (E, S, "gpt2_forward", "Layer 0", "layernorm_forward")),
        ("GEMM", 1, "fprop", 0, "matmul_forward", "h.0.attn.c_attn",
         (E, S, "gpt2_forward", "Layer 0", "matmul_forward")),
        ("permute_kernel", 1, "fprop", 0, "attention_forward", "h.0.attn",
         (E, S, "gpt2_forward", "Layer 0", "attention_forward")),
        ("softmax_forward_kernel", 1, "fprop", 0, "attention_forward", "h.0.attn",
         (E, S, "gpt2_forward", "Layer 0", "attention_forward")),
        ("GEMM", 1, "fprop", 0, "matmul_forward", "h.0.attn.c_proj",
         (E, S, "gpt2_forward", "Layer 0", "matmul_forward")),
        ("layernorm_forward_kernel", 1, "fprop", None, "layernorm_forward", "ln_f",
         (E, S, "gpt2_forward", "layernorm_forward")),
        ("GEMM", 1, "bprop", 0, "matmul_backward", "h.0.mlp.c_proj",
         (E, S, "gpt2_backward", "Layer 0", "matmul_backward")),
        ("GEMM", 1, "bprop", 0, "matmul_backward", "h.0.mlp.c_proj",
         (E, S, "gpt2_backward", "Layer 0", "matmul_backward")),
        ("matmul_backward_bias_kernel", 1, "bprop", 0, "matmul_backward", "h.0.mlp.c_proj",
         (E, S, "gpt2_backward", "Layer 0", "matmul_backward")),
        ("GEMM", 1, "bprop", 0, "matmul_backward", "h.0.mlp.c_fc",
         (E, S, "gpt2_backward", "Layer 0", "matmul_backward")),
        ("straddling_kernel", 1, "bprop", None, "", "", (E, S, "gpt2_backward")),
        ("adamw_kernel", 1, "update", None, "adamw", "optimizer", (E, S, "gpt2_update", "adamw")),
        ("orphan_kernel", None, "other", None, "", "", ()),
    ]
    assert [r.idx for r in records] == list(range(len(records)))
    assert records[4].params == "grid=(4,1,1) block=(256,1,1)"
    assert records[4].duration_ns == 300 and records[4].start_ns == 1_750 + 50_000
    assert all(r.flops == 0 and r.bytes == 0 for r in records)
    assert "16 kernels" in nsys.summary_line(profile)
    assert "14 launched inside NVTX ranges, 1 outside any range, 1 without a launch record" \
        in nsys.summary_line(profile)


def test_ranges_carry_thread_and_domain(step_db):
    _, ranges, _, _ = nsys.read_report(step_db)
    names = sorted(r[0] for r in ranges)
    assert names.count("Layer 0") == 2 and names.count("matmul_forward") == 2
    assert ("gpt2np:epoch", 900, 40_000, 4242) in ranges
    assert ("Layer 7", 1_450, 1_560, 4250) in ranges
    table = report.range_table(ranges)
    layer0 = next(line for line in table.splitlines() if line.endswith("Layer 0"))
    # two instances: 6600 ns and 4800 ns -> total 11400, avg 5700, stddev sqrt(((900)^2*2)/1)
    assert layer0.split()[1:8] == ["11,400", "2", "5,700.0", "5,700.0", "4,800", "6,600", "1,272.8"]


def test_short_names(step_db):
    records, _, _, _ = nsys.read_report(step_db, "shortName")
    assert records[4].kernel == "Kernel2"


def test_unclosed_range_and_cross_thread_startend(tmp_path):
    e = Export()
    # never popped: runs to the last timestamp
    e.range("Train step 3", 100, None)
    e.range("gpt2_forward", 150, 900)
    e.range("async_io", 120, 950, event_type=60, end_tid=LOADER)   # ended on another thread
    e.range("late", 2_000, 2_100)
    e.launch("k", 200)
    records, ranges, _, _ = nsys.read_report(e.write(tmp_path / "p.sqlite"))
    assert records[0].range_stack == ("Train step 3", "gpt2_forward")
    assert records[0].step == 3 and records[0].direction == "fprop" and records[0].op == ""
    assert ("Train step 3", 100, 2_100, 4242) in ranges
    assert ("async_io", 120, 950, None) in ranges


def test_an_unclosed_range_ends_at_the_last_integer_timestamp(tmp_path):
    e = Export()
    e.domain(1, "gpt2np")
    # never popped: runs to the last timestamp
    e.range("Train step 3", 100, None)
    e.range("late", 2_000, 2_100)
    e.launch("k", 200)
    path = e.write(tmp_path / "p.sqlite")
    con = loosened(path, "NVTX_EVENTS")
    # not a range
    con.execute("UPDATE NVTX_EVENTS SET start = 'x' WHERE eventType = ?",
                (nsys.NVTX_DOMAIN_CREATE,))
    con.commit()
    con.close()
    # was a TypeError: text sorts after every number in SQL
    _, ranges, _, _ = nsys.read_report(path)
    assert ("Train step 3", 100, 2_100, 4242) in ranges


def test_explicit_module_ranges(tmp_path):
    e = Export()
    e.range("Train step 2", 0, 1_000)
    e.range("gpt2_backward", 10, 900)
    e.range("h.5.mlp.c_fc", 20, 100)
    e.range("matmul_backward_cublaslt", 30, 90)
    e.launch("k", 40)
    [rec], _, _, _ = nsys.read_report(e.write(tmp_path / "p.sqlite"))
    assert (rec.step, rec.direction, rec.layer, rec.op, rec.module) == \
        (2, "bprop", 5, "matmul_backward_cublaslt", "h.5.mlp.c_fc")


def test_cli_prints_tables_and_writes_files(step_db, tmp_path, capsys):
    out_csv, out_json, out_trace = tmp_path / "k.csv", tmp_path / "k.json", tmp_path / "t.json"
    assert nsys_cli.main([step_db, "--csv", str(out_csv), "--json", str(out_json), "--trace",
                          str(out_trace)]) == 0
    text = capsys.readouterr().out
    for heading in ("Kernels of step 1 on H100 SXM", "GPT-2 modules: parameters and time",
                    "Time per layer", "Time per op", "Phases: forward / backward",
                    "GPU activities (kernels, copies, memsets)", "API calls (host time)",
                    "User ranges, PyTorch profiler layout", "Top kernels (whole profile)",
                    "NVTX ranges projected onto the GPU"):
        assert heading in text
    assert "c_attn" in text and "matmul_backward" in text
    records, _, meta = report.read_json(str(out_json))
    assert len(records) == 16 and meta["device"] == "NVIDIA H100 80GB HBM3"
    assert out_csv.read_text().count("\n") == 17
    trace = json.loads(out_trace.read_text())
    assert sum(1 for ev in trace["traceEvents"] if ev.get("cat") == "kernel") == 16


def test_cli_step_all_and_device_override(step_db, capsys):
    assert nsys_cli.main([step_db, "--step", "all", "--device", "A100-SXM4-80GB"]) == 0
    text = capsys.readouterr().out
    assert "on A100 80GB SXM" in text and "orphan_kernel" in text and "warmup_kernel" in text


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_missing_file(tmp_path, capsys):
    path = str(tmp_path / "nope.sqlite")
    with pytest.raises(nsys.NsysReportMissing, match="no such file"):
        nsys.load(path)
    assert nsys_cli.main([path]) == 2
    assert path in one_error_line(capsys)


def test_not_sqlite(tmp_path, capsys):
    path = tmp_path / "prof.nsys-rep"
    path.write_bytes(b"this is not a database" * 100)
    assert nsys_cli.main([str(path)]) == 2
    assert "not an SQLite file" in one_error_line(capsys)


@pytest.mark.parametrize("dropped, problem", [("CUPTI_ACTIVITY_KIND_KERNEL", "no CUDA kernel data"),
                                              ("NVTX_EVENTS", "no NVTX data"),
                                              ("CUPTI_ACTIVITY_KIND_RUNTIME", "no CUDA API data")])
def test_missing_tables(tmp_path, capsys, dropped, problem):
    path = training_step_export().write(tmp_path / "p.sqlite")
    con = sqlite3.connect(path)
    con.execute(f"DROP TABLE {dropped}")
    con.commit()
    con.close()
    with pytest.raises(nsys.NsysReportError, match=problem):
        nsys.load(path)
    assert nsys_cli.main([path]) == 2
    err = one_error_line(capsys)
    assert path in err and problem in err


def loosened(path, table):
    """A connection to the export with `table` remade without its NOT NULL constraints (nsys
    declares its times INTEGER NOT NULL; a damaged export, or another tool's, may hold
    NULL or text there)."""
    con = sqlite3.connect(path)
    con.executescript(f"CREATE TABLE loose AS SELECT * FROM {table}; DROP TABLE {table}; "
                      f"ALTER TABLE loose RENAME TO {table};")
    return con


@pytest.mark.parametrize("table, column, sql, problem", [
    ("CUPTI_ACTIVITY_KIND_KERNEL", "start", "NULL",
     "column 'start' must be an integer timestamp (ns), got NULL"),
    ("CUPTI_ACTIVITY_KIND_KERNEL", "end", "'soon'",
     "column 'end' must be an integer timestamp (ns), got 'soon'"),
    ("CUPTI_ACTIVITY_KIND_KERNEL", "end", "start - 1000", "end 50500 is before start 51500"),
    ("CUPTI_ACTIVITY_KIND_RUNTIME", "end", "NULL",
     "column 'end' must be an integer timestamp (ns), got NULL"),
    ("CUPTI_ACTIVITY_KIND_MEMCPY", "start", "1.5",
     "column 'start' must be an integer timestamp (ns), got 1.5"),
    ("CUPTI_ACTIVITY_KIND_MEMSET", "bytes", "'lots'",
     "column 'bytes' must be an integer, got 'lots'"),
    ("NVTX_EVENTS", "start", "'x'", "column 'start' must be an integer timestamp (ns), got 'x'"),
])
def test_a_null_or_text_value_is_an_error_naming_the_file_table_and_column(tmp_path, capsys, table,
                                                                           column, sql, problem):
    path = copies_export().write(tmp_path / "p.sqlite")
    con = loosened(path, table)
    first = con.execute(f"SELECT min(rowid) FROM {table} WHERE eventType = 59"
                        if table == "NVTX_EVENTS"
                        else f"SELECT min(rowid) FROM {table}").fetchone()[0]
    con.execute(f"UPDATE {table} SET {column} = {sql} WHERE rowid = ?", (first,))
    con.commit()
    con.close()
    with pytest.raises(nsys.NsysReportError, match=f"{table} row {first}: "):
        nsys.load(path)
    # was a TypeError without the file, or a negative duration
    assert nsys_cli.main([path]) == 2
    err = one_error_line(capsys)
    assert f"{path}: {table} row {first}: {problem}" in err


def test_unknown_device_is_one_line(step_db, capsys):
    assert nsys_cli.main([step_db, "--device", "Voodoo5"]) == 2
    assert "unknown device 'Voodoo5'" in one_error_line(capsys)


# llm.c's (and gpt2np.model's without fused ops or recompute) op order inside one layer, with the
# module each call computes
FORWARD_LAYER = [("layernorm_forward", "ln_1"), ("matmul_forward", "attn.c_attn"),
                 ("attention_forward", "attn"),
                 ("matmul_forward", "attn.c_proj"), ("residual_forward", "residual"),
                 ("layernorm_forward", "ln_2"), ("matmul_forward", "mlp.c_fc"),
                 ("gelu_forward", "mlp.gelu"),
                 ("matmul_forward", "mlp.c_proj"), ("residual_forward", "residual")]
BACKWARD_LAYER = [("matmul_backward", "mlp.c_proj"), ("gelu_backward", "mlp.gelu"),
                  ("matmul_backward", "mlp.c_fc"), ("layernorm_backward", "ln_2"),
                  ("matmul_backward", "attn.c_proj"), ("attention_backward", "attn"),
                  ("matmul_backward", "attn.c_attn"), ("layernorm_backward", "ln_1")]


def test_modules_of_a_full_step_with_gradient_accumulation(tmp_path):
    """Two micro-batches per step, two layers: every op lands on its module, in both passes."""
    e, t, expected = Export(), 0, []

    def op(name, module, kernels=1):
        nonlocal t
        start = t
        for _ in range(kernels):
            e.launch(f"{name}_kernel", t + 10)
            expected.append(module)
            t += 100
        e.range(name, start, t)
        t += 10

    def scope(name, body):
        nonlocal t
        start = t
        t += 5
        body()
        e.range(name, start, t)
        t += 5

    def forward():
        op("encoder_forward", "wte")
        for l in range(2):
            scope(f"Layer {l}", lambda l=l: [op(n, f"h.{l}.{m}") for n, m in FORWARD_LAYER])
        op("layernorm_forward", "ln_f")
        op("matmul_forward", "lm_head")
        op("fused_classifier", "lm_head")

    def backward():
        op("matmul_backward", "lm_head", kernels=2)
        op("layernorm_backward", "ln_f")
        for l in (1, 0):
            scope(f"Layer {l}", lambda l=l: [op(n, f"h.{l}.{m}",
                                                kernels=3 if n == "matmul_backward" else 1)
                                             for n, m in BACKWARD_LAYER])
        op("encoder_backward", "wte")

    def step():
        for _ in range(2):
            scope("gpt2_forward", forward)
            scope("gpt2_backward", backward)
        scope("gpt2_calculate_grad_norm", lambda: op("global_norm", "optimizer"))
        scope("gpt2_update", lambda: [op("adamw", "optimizer") for _ in range(16)])

    scope("Train step 0", step)
    records, _, _, _ = nsys.read_report(e.write(tmp_path / "p.sqlite"))
    assert [r.module for r in records] == expected
    assert {r.step for r in records} == {0}
    assert [r.direction for r in records if r.op == "global_norm"] == ["update"]
    tree = report.module_tree(records)
    c_attn = next(n for _, n in tree.walk() if n.path == "h.1.attn.c_attn")
    assert (c_attn.calls == 2 * (1 + 3) and c_attn.time("fprop") == 2 * 300
            and c_attn.time("bprop") == 2 * 3 * 300)


def profiled_step_export(path, keep=None, **settings):
    """(the built-in profiler's kernel records of one training step, the export of that step) for a
    3-layer model (a first, a middle and a last layer) on the emulated CUDA backend with `settings`
    (GPT2's fuse, gelu_fusion, attention, recompute): every range the model opened becomes an NVTX
    push/pop range (host times x 1000, room for the launch calls), every kernel a launch inside the
    op range the profiler saw it launched in; only the kernels keep(record) accepts, where given (a
    capture filtered by kernel name: the ranges stay)."""
    import numpy as np

    from gpt2np.backends import get_backend
    from gpt2np.config import GPT2Config
    from gpt2np.model import GPT2
    from gpt2np.profiling.profiler import profile_steps
    # flash attention: head size 64
    cfg, B, T = GPT2Config(32, 100, 128, 3, 1, 64), 2, 8
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    model = GPT2(cfg, get_backend("emu"), B, T, seed=0, **settings)
    prof = profile_steps(model, [(tokens[:, :-1], tokens[:, 1:])], steps=1)
    e, scale = Export(), 1000
    spans = {r.id: (r.start_ns * scale, r.end_ns * scale) for r in prof.range_instances}
    for r in prof.range_instances:
        e.range(r.name, *spans[r.id])
    kernels = [r for r in prof.records if r.kind == "kernel" and (keep is None or keep(r))]
    by_range = {}
    for r in kernels:
        by_range.setdefault(r.range_ids[-1], []).append(r)
    for rid, launched in by_range.items():           # spread over their range, in launch order
        start, end = spans[rid]
        for i, r in enumerate(launched):
            e.launch(r.kernel, start + (end - start) * (i + 1) // (len(launched) + 1))
    return kernels, e.write(path)


@pytest.mark.parametrize("settings", [
    # a GPU run's defaults: fuse 1, -ge 2, flash, -r 0
    {"attention": "flash"},
    {"fuse": False},                                          # no fused op, naive attention
    {"fuse": False, "attention": "flash", "recompute": 1},
    {"gelu_fusion": 1, "recompute": 1},
    {"gelu_fusion": 0, "recompute": 2},
    {"attention": "flash", "recompute": 2},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_an_export_of_gpt2nps_own_step_gets_the_modules_the_model_names(tmp_path, settings):
    """NVTX carries only the op names: the module of each op comes from gpt2np.model's order of them
    (fused, flash, recomputing or not), the same as the model names to the built-in profiler, and so
    the layer (the fused residual + LayerNorm ending "Layer l" computes h.{l+1}.ln_1, or ln_f)."""
    truth, path = profiled_step_export(tmp_path / "p.sqlite", **settings)
    records, _, _, _ = nsys.read_report(path)
    # the export is the step
    assert [r.range_stack for r in records] == [r.range_stack for r in truth]
    got = [(r.op, r.module, r.direction, -1 if r.layer is None else r.layer) for r in records]
    assert got == [(r.op, r.module, r.direction, r.layer) for r in truth]
    assert {r.step for r in records} == {1}


@pytest.mark.parametrize("settings, dropped", [
    # the fused residual + LayerNorm and LayerNorm kernels
    ({"attention": "flash"}, "layernorm"),
    ({"attention": "flash"}, "flash"),
    ({"attention": "flash", "recompute": 2}, "layernorm"),
    ({"gelu_fusion": 1, "recompute": 1}, "layernorm"),
    ({"fuse": False}, "layernorm"),
    # attention's own kernels (its GEMMs stay)
    ({"fuse": False}, "attention"),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_an_export_missing_some_ops_kernels_still_gets_the_models_modules(tmp_path, settings,
                                                                          dropped):
    """A capture filtered by kernel name leaves some op ranges of a layer without kernels: the other
    ops' modules come from the one place of gpt2np's op orders that fits what is left (before:
    llm.c's order by position, which failed the first four cases here; the unfused ones are llm.c's
    order). Not covered: what is left fitting two orders (the GELU-fused c_fc GEMM filtered out: the
    next GEMM is c_proj after it, or c_fc of an unfused order)."""
    truth, path = profiled_step_export(tmp_path / "p.sqlite",
                                       keep=lambda r: dropped not in r.kernel.lower(), **settings)
    records, _, _, _ = nsys.read_report(path)
    assert records and len(records) == len(truth)
    assert [(r.op, r.module, r.layer if r.layer is not None else -1) for r in records] == \
        [(r.op, r.module, r.layer) for r in truth]


def test_gpt2nps_op_orders_are_read_off_the_model():
    """Every fuse / GELU fusion / attention / recompute order of gpt2np.model tells one module per
    op (else model_op_modules raises), fused ops included."""
    layers, outside = nsys.model_op_modules()
    modules = {(direction, op, place) for (direction, _, op), place in layers.items()}
    assert {("fprop", "matmul_gelu_forward", (0, "mlp.c_fc")),
            ("bprop", "gelu_matmul_backward", (0, "mlp.c_proj")),
            ("fprop", "fused_residual_layernorm_forward", (0, "ln_2")),
            ("fprop", "fused_residual_layernorm_forward", (1, "ln_1")),
            ("fprop", "flash_attention_forward", (0, "attn")),
            ("bprop", "flash_attention_backward", (0, "attn")),
            ("bprop", "gelu_forward", (0, "mlp.gelu")),
            ("bprop", "layernorm_forward", (0, "ln_1"))} <= modules
    fused = ("matmul_forward", "flash_attention_forward", "matmul_forward",
             "fused_residual_layernorm_forward", "matmul_gelu_forward")
    assert layers[("fprop", fused, "matmul_forward")] == (0, "mlp.c_proj")
    assert (nsys.infer_module("fused_residual_layernorm_forward", "fprop", 1, 1,
                              fused + ("matmul_forward",), 3) == ("h.2.ln_1", 2))
    assert (nsys.infer_module("fused_residual_layernorm_forward", "fprop", 2, 1,
                              fused + ("matmul_forward",), 3) == ("ln_f", None))
    assert outside["loss_mean"] == "lm_head"


def test_gpu_projection(step_db):
    profile = nsys.load(step_db)
    spans = {}
    for name, start, end in nsys.gpu_projection(profile.kernels):
        spans.setdefault(name, []).append((start, end))
    # kernels run 50 us after their launch and last 300 ns
    assert spans["Layer 0"] == [(51_550, 52_550), (59_350, 60_050)]
    assert spans["matmul_backward"] == [(59_350, 59_750), (59_750, 60_050)]
    assert spans["Train step 1"] == [(51_250, 65_550)]
    assert "data_loader" in spans and "gpt2np:epoch" in spans


SGEMM = "volta_sgemm_128x64_tn"


def llmc_export():
    """One training step of llm.c's train_gpt2cu (fp32, one layer) with its own NVTX and kernel
    names: gpt2_backward_and_reduce, classifier_and_loss around the rest of the backward pass, the
    generic matmul_cublaslt range (nested inside attention_* and matmul_backward), kernels
    with no op range."""
    e = Export()
    t = [1_000]

    def at(step=100):
        t[0] += step
        return t[0]

    def rng(name, body):
        start = at(10)
        body()
        # after the last launch call (20 ns) has returned
        e.range(name, start, at(30))

    def k(name):
        return lambda: e.launch(name, at())

    def seq(*parts):
        return lambda: [p() for p in parts]

    def gemm():
        return lambda: rng("matmul_cublaslt", k(SGEMM))

    forward_layer = seq(gemm(),                                                           # qkv
                        lambda: rng("attention_forward", seq(k("permute_kernel"), gemm(),
                                                             k("softmax_forward_kernel5"), gemm(),
                                                             k("unpermute_kernel"))),
                        # attention proj
                        gemm(),
                        k("fused_residual_forward_kernel5"),
                        gemm(),                                                           # fc
                        lambda: rng("gelu_forward", k("gelu_forward_kernel2")),
                        gemm(),                                                           # mlp proj
                        k("fused_residual_forward_kernel5"))

    def matmul_backward(with_gelu=False):
        parts = [k("void matmul_backward_bias_kernel9<float, bool=1>"), gemm()]
        if with_gelu:
            parts.append(lambda: rng("gelu_backward_inplace", k("gelu_backward_inplace_kernel")))
        parts.append(gemm())
        return lambda: rng("matmul_backward", seq(*parts))

    backward_layer = seq(matmul_backward(with_gelu=True),                                 # mlp proj
                         matmul_backward(),                                               # fc
                         lambda: rng("layernorm_backward", k("layernorm_backward_kernel10")),
                         # attention proj
                         matmul_backward(),
                         lambda: rng("attention_backward",
                                     seq(k("unpermute_kernel_backward"), gemm(), gemm(),
                                         k("softmax_autoregressive_backward_inplace_kernel"),
                                         gemm(), gemm(), k("permute_kernel_backward"))),
                         matmul_backward(),                                               # qkv
                         lambda: rng("layernorm_backward", k("layernorm_backward_kernel10")))
    step = seq(
        lambda: rng("gpt2_forward", seq(lambda: rng("encoder_forward",
                                                    k("encoder_forward_kernel3")),
                                        lambda: rng("layernorm_forward",
                                                    k("layernorm_forward_kernel6")),
                                        lambda: rng("Layer 0", forward_layer),
                                        gemm())),                                         # lm_head
        lambda: rng("gpt2_backward_and_reduce", lambda: rng("classifier_and_loss", seq(
            lambda: rng("fused_classifier", k("void fused_classifier_kernel5<bool=1, bool=0>")),
            lambda: rng("matmul_backward", seq(gemm(), gemm())),                          # lm_head
            lambda: rng("layernorm_backward", k("layernorm_backward_kernel10")),
            lambda: rng("Layer 0", backward_layer),
            lambda: rng("encoder_backward",
                        seq(k("void wte_backward_kernel<int=256>"), k("wpe_backward_kernel"))),
        ))),
        lambda: rng("gpt2_calculate_grad_norm", k("void global_norm_squared_kernel<float>")),
        lambda: rng("gpt2_update", seq(k("void adamw_kernel3<float, float>"),
                                       k("void adamw_kernel3<float, float>"))))
    rng("Train step 3", step)
    return e


def test_llmc_names_map_to_layer_op_direction_and_module(tmp_path):
    records, _, _, _ = nsys.read_report(llmc_export().write(tmp_path / "llmc.sqlite"))
    got = [(r.direction, r.layer_index, r.op, r.module, r.kernel) for r in records]
    assert all(r.step == 3 for r in records)
    fwd = [(op, module) for d, layer, op, module, kernel in got if d == "fprop" and kernel == SGEMM]
    assert fwd == [("matmul_cublaslt", "h.0.attn.c_attn"), ("attention_forward", "h.0.attn"),
                   ("attention_forward", "h.0.attn"), ("matmul_cublaslt", "h.0.attn.c_proj"),
                   ("matmul_cublaslt", "h.0.mlp.c_fc"), ("matmul_cublaslt", "h.0.mlp.c_proj"),
                   ("matmul_cublaslt", "lm_head")]
    residual = [module for d, _, op, module, _ in got if op == "fused_residual_forward"]
    assert residual == ["h.0.ln_2", "h.0.ln_1"]
    bwd = [module for d, layer, op, module, kernel in got
           if d == "bprop" and op == "matmul_backward" and kernel == SGEMM]
    assert (bwd == ["lm_head"] * 2 + ["h.0.mlp.c_proj"] * 2 + ["h.0.mlp.c_fc"] * 2
            + ["h.0.attn.c_proj"] * 2 + ["h.0.attn.c_attn"] * 2)
    assert ([module for *_, op, module, kernel in got
             if kernel == SGEMM and op == "attention_backward"] == ["h.0.attn"] * 4)
    gelu = next(x for x in got if x[4] == "gelu_backward_inplace_kernel")
    assert gelu[:4] == ("bprop", 0, "gelu_backward_inplace", "h.0.mlp.gelu")
    by_kernel = {kernel: (d, layer, module) for d, layer, op, module, kernel in got}
    assert by_kernel["void fused_classifier_kernel5<bool=1, bool=0>"] == ("bprop", None, "lm_head")
    assert by_kernel["void wte_backward_kernel<int=256>"] == ("bprop", None, "wte")
    assert by_kernel["wpe_backward_kernel"] == ("bprop", None, "wpe")
    assert by_kernel["void adamw_kernel3<float, float>"] == ("update", None, "optimizer")
    assert by_kernel["void global_norm_squared_kernel<float>"] == ("update", None, "optimizer")
    assert {d for d, layer, *_ in got if layer == 0} == {"fprop", "bprop"}
    # the module tree of the import: llm.c's step splits into the same modules as ours
    tree = report.module_tree(records, num_layers=1)
    names = {node.path: node for _, node in tree.walk()}
    assert (names["h.0.attn.c_attn"].calls == 1 + 3 and names["wpe"].calls == 1
            and names["lm_head"].calls == 4)


# ---------------------------------------------------------------------------------------------
# the profiler's views of an export (gpt2np.profiling.render.views, the same renderers)

from gpt2np.profiling.render import views as V  # noqa: E402


def copies_export():
    """Two training steps of our own range names with copies and memsets: inputs up, the loss down,
    a memset of the gradients, a device-to-device copy in the update, and an upload
    before any range."""
    e = Export()
    e.copy(HTOD, 4096, 100)                                            # weights, before the steps
    for step, t in ((1, 1_000), (2, 100_000)):
        e.range(f"Train step {step}", t, t + 20_000)
        e.range("gpt2_forward", t + 100, t + 5_000)
        e.range("encoder_forward", t + 200, t + 900)
        e.copy(HTOD, 256, t + 300, duration=2_000)                      # inputs
        e.copy(HTOD, 256, t + 400, duration=2_000)                      # targets
        e.launch("encoder_forward_kernel", t + 500)
        e.range("Layer 0", t + 1_000, t + 3_000)
        e.range("matmul_forward", t + 1_100, t + 1_300)
        e.launch(GEMM, t + 1_200)
        e.range("fused_classifier", t + 3_100, t + 3_500)
        e.launch("fused_classifier_kernel", t + 3_200)
        e.copy(DTOH, 128, t + 3_300, api="cudaMemcpy_v3020", duration=1_000)   # the losses
        e.range("gpt2_backward", t + 5_100, t + 12_000)
        e.copy(None, 8192, t + 5_200, api="cudaMemsetAsync_v3020", memset=True, duration=500)
        e.range("matmul_backward", t + 5_300, t + 5_600)
        e.launch(GEMM, t + 5_400)
        e.launch(GEMM, t + 5_500)
        e.range("gpt2_update", t + 12_100, t + 19_000)
        e.range("adamw", t + 12_200, t + 12_500)
        e.launch("adamw_kernel", t + 12_300)
        e.copy(DTOD, 1024, t + 12_400, duration=700)
    return e


@pytest.fixture
def copies_db(tmp_path):
    return copies_export().write(tmp_path / "copies.sqlite")


def nsys_views(path, **kw):
    records, _, _, profile = nsys.read_report(path)
    return nsys.views_profile(profile, records, **kw)


def rows_by(table, key, value):
    cols = [c for c, _ in table.columns]
    return {row[cols.index(key)]: row[cols.index(value)] for row in table.rows}


def test_copies_and_memsets_are_records_attributed_to_their_ranges(copies_db):
    records, _, _, profile = nsys.read_report(copies_db)
    copies = [r for r in records if r.kind != "kernel"]
    assert len(profile.kernels) == 12 and len(copies) == 1 + 2 * 5
    assert "11 copies and memsets; 23 CUDA API calls; 20 NVTX ranges" in nsys.summary_line(profile)
    assert [r.idx for r in records] == list(range(len(records)))
    first = records[0]
    assert (first.kind, first.kernel, first.bytes, first.step, first.range_stack) == \
        ("memcpy", "[CUDA memcpy HtoD]", 4096, None, ())
    step1 = [r for r in copies if r.step == 1]
    assert [(r.kernel, r.bytes, r.direction, r.op) for r in step1] == [
        ("[CUDA memcpy HtoD]", 256, "fprop", "encoder_forward"),
        ("[CUDA memcpy HtoD]", 256, "fprop", "encoder_forward"),
        ("[CUDA memcpy DtoH]", 128, "fprop", "fused_classifier"),
        ("[CUDA memset]", 8192, "bprop", ""), ("[CUDA memcpy DtoD]", 1024, "update", "adamw")]
    assert (step1[0].duration_ns == 2_000
            and step1[0].range_stack == ("Train step 1", "gpt2_forward", "encoder_forward"))
    assert all(len(r.range_ids) == len(r.range_stack) for r in records)


def test_copy_kinds_from_the_enum_table_or_cuptis_numbering(tmp_path):
    assert ([nsys.copy_kind_name(n)
             for n in ("CUDA_MEMCPY_KIND_HTOD", "CUDA_MEMCPY_KIND_PTOP",
                       "CUDA_MEMCPY_KIND_UVM_HTOD", "CUDA_MEMCPY_KIND_UNKNOWN")]
            == ["HtoD", "PtoP", "Unified HtoD", "Unknown"])
    e = copies_export()
    e.copy(11, 64, 500_000)
    with_enum = [r.kernel for r in nsys.read_report(e.write(tmp_path / "a.sqlite"))[0]
                 if r.kind == "memcpy"]
    # an export without ENUM_CUDA_MEMCPY_OPER
    e.copy_enum = False
    without = [r.kernel for r in nsys.read_report(e.write(tmp_path / "b.sqlite"))[0]
               if r.kind == "memcpy"]
    assert with_enum[-1] == "[CUDA memcpy Unified HtoD]" and with_enum[:-1] == without[:-1]
    assert V.nsys_mem_name("[CUDA memcpy Unified HtoD]") == "[CUDA memcpy Unified Host-to-Device]"


def test_gpu_activities_and_nsys_memory_reports_of_an_export(copies_db):
    profile = V.select(nsys_views(copies_db), "last")
    acts = V.tables(profile, "gpu_activities")[0]
    calls = rows_by(acts, "Name", "Calls")
    assert calls == {"[CUDA memcpy HtoD]": 2, "[CUDA memcpy DtoH]": 1, "[CUDA memcpy DtoD]": 1,
                     "[CUDA memset]": 1, GEMM: 3, "encoder_forward_kernel": 1,
                     "fused_classifier_kernel": 1, "adamw_kernel": 1}
    assert rows_by(acts, "Name", "Time")["[CUDA memcpy HtoD]"] == "4us"
    assert acts.rows[0][-1] == "[CUDA memcpy HtoD]"                     # most time first
    time_sum = V.tables(profile, "cuda_gpu_mem_time_sum")[0]
    assert rows_by(time_sum, "Operation", "Count") == {"[CUDA memcpy Host-to-Device]": "2",
                                                        "[CUDA memcpy Device-to-Host]": "1",
                                                        "[CUDA memcpy Device-to-Device]": "1",
                                                        "[CUDA memset]": "1"}
    assert (rows_by(time_sum, "Operation", "Total Time (ns)")["[CUDA memcpy Host-to-Device]"]
            == "4,000")
    size_sum = V.tables(profile, "cuda_gpu_mem_size_sum")[0]
    assert rows_by(size_sum, "Operation", "Total (MB)") == {
        "[CUDA memset]": "0.008", "[CUDA memcpy Device-to-Device]": "0.001",
        "[CUDA memcpy Host-to-Device]": "0.001", "[CUDA memcpy Device-to-Host]": "0.000"}
    kern_sum = V.tables(profile, "cuda_gpu_kern_sum")[0]
    assert rows_by(kern_sum, "Name", "Instances") == {GEMM: "3", "encoder_forward_kernel": "1",
                                                       "fused_classifier_kernel": "1",
                                                       "adamw_kernel": "1"}


def test_api_calls_of_an_export(copies_db):
    whole = nsys_views(copies_db)
    by_idx = {r.idx: r for r in whole.records}
    # every call tied to what it issued
    for call in whole.api:
        issued = by_idx[call.record]
        assert call.name in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync")
        assert issued.kind == {"cudaLaunchKernel": "kernel",
                               "cudaMemsetAsync": "memset"}.get(call.name, "memcpy")
    profile = V.select(whole, "last")
    api = V.tables(profile, "api_calls")[0]
    assert rows_by(api, "Name", "Calls") == {"cudaLaunchKernel": 6, "cudaMemcpyAsync": 3,
                                             "cudaMemcpy": 1, "cudaMemsetAsync": 1}
    nsys_api = V.tables(profile, "cuda_api_sum")[0]
    assert rows_by(nsys_api, "Name", "Num Calls")["cudaMemcpyAsync"] == "3"
    assert rows_by(nsys_api, "Name", "Total Time (ns)")["cudaLaunchKernel"] == "120"


def test_ranges_nest_per_thread_and_carry_their_step(copies_db):
    profile = nsys_views(copies_db)
    by_id = {r.id: r for r in profile.ranges}
    enc = [r for r in profile.ranges if r.name == "encoder_forward"]
    assert [r.step for r in enc] == [1, 2] and all(r.depth == 2 for r in enc)
    assert [by_id[by_id[r.parent].parent].name for r in enc] == ["Train step 1", "Train step 2"]
    assert all(r.parent is None for r in profile.ranges if r.name.startswith("Train step"))
    # the training step export: a second thread's ranges nest on their own thread; a start/end range
    # around the step is its parent
    steps = nsys_views(training_step_export().write(str(copies_db) + ".2"))
    names = {r.id: r.name for r in steps.ranges}
    parent_of = {r.name: names.get(r.parent) for r in steps.ranges}
    assert parent_of["Train step 1"] == "gpt2np:epoch" and parent_of["Layer 7"] == "data_loader"
    styles = {row[-1]: row[-2] for row in V.tables(steps, "nvtx_sum")[0].rows}
    assert styles["gpt2np:epoch"] == "StartEnd" and styles["Train step 1"] == "PushPop"


def test_nvtx_views_and_user_ranges_of_an_export(copies_db):
    profile = V.select(nsys_views(copies_db), "last")
    kern = V.tables(profile, "nvtx_kern_sum")[0]
    rows = {(row[0], row[-1]): row for row in kern.rows}
    # NVTX Inst, Kern Inst
    assert rows[("encoder_forward", "[CUDA memcpy HtoD]")][2:4] == [1, 2]
    assert rows[("gpt2_backward", GEMM)][3] == 2 and rows[("Train step 2", GEMM)][3] == 3
    nvtx = V.tables(profile, "nvtx_sum")[0]
    assert rows_by(nvtx, "Range", "Instances")["Train step 2"] == "1"
    assert rows_by(nvtx, "Range", "Total Time (ns)")["gpt2_update"] == "6,900"
    users = {row[0]: row for row in V.tables(profile, "user_ranges")[0].rows}
    assert {"train_step-2", "forward", "backward", "optimizer", "cudaLaunchKernel"} <= set(users)
    # CPU total %: the step is all of it
    assert users["train_step-2"][3] == "100.00%"
    fwd = sum(r.duration_ns for r in profile.records if r.direction == "fprop")
    assert users["forward"][8] == V.nvprof_time(fwd) and fwd == 2 * 2_000 + 1_000 + 3 * 300


def test_module_tree_with_a_preset_parameters(copies_db, capsys):
    profile = V.select(nsys_views(copies_db, module_params=nsys.preset_parameters("d12")), "last")
    tree = V.tables(profile, "modules")[0]
    params = {name.strip(): count
              for name, count in zip(*[[row[i] for row in tree.rows] for i in (0, 1)])}
    assert params["gpt2"] == "124,475,904" and params["wpe"] == f"{1024 * 768:,}"
    assert (profile.meta["num_layers"] == 12
            and len([r for r in tree.rows if r[0].strip().startswith("h.")]) == 12)
    assert nsys_cli.main([copies_db, "--model", "d99"]) == 2
    assert "--model d99" in one_error_line(capsys)


def test_llmc_export_goes_through_every_view(tmp_path):
    """llm.c's names (gpt2_backward_and_reduce, matmul_cublaslt, classifier_and_loss ...)
    through all the views."""
    e = llmc_export()
    # llm.c uploads inputs and targets first
    e.copy(HTOD, 8 * 65 * 4, 1_010)
    # ... and reads the losses back
    e.copy(DTOH, 8 * 64 * 4, 2_500)
    profile = nsys_views(e.write(tmp_path / "llmc.sqlite"),
                         module_params=nsys.preset_parameters("d12"))
    step = V.select(profile, "last")
    for name in V.VIEWS:
        result = V.tables(step, name)
        # an export knows no buffers or collectives
        if name in ("model", "comm"):
            assert result[0].rows == [], name
            continue
        assert all(t.rows for t in result), name
    phases = V.tables(step, "phases")[0]
    host = rows_by(phases, "phase", "host range time (us)")
    assert float(host["backward"]) > 0 and float(host["optimizer"]) > 0
    assert sum(rows_by(phases, "phase", "copies+memsets").values()) == 2
    users = {row[0] for row in V.tables(step, "user_ranges")[0].rows}
    assert ({"train_step-3", "forward", "backward", "optimizer", "clip-grads", "matmul_cublaslt"}
            <= users)
    kern = {(row[0], row[-1]) for row in V.tables(step, "nvtx_kern_sum")[0].rows}
    assert ("gpt2_backward_and_reduce", "void wte_backward_kernel<int=256>") in kern
    assert ("gpt2_update", "void adamw_kernel3<float, float>") in kern
    pyprof = V.tables(step, "pyprof")[0]
    assert {row[1] for row in pyprof.rows} == {"fprop", "bprop", "update", "other"}
    text = V.render_views(profile, None, V.VIEWS)
    # GPU times: no note
    assert "emulated" not in text and report.NUMPY_NOTE not in text
    assert "[CUDA memcpy HtoD]" in text and "Kernels of step 3" in text


def test_cli_views_and_files(copies_db, tmp_path, capsys):
    out, js, trace = tmp_path / "out", tmp_path / "p.json", tmp_path / "t.json"
    assert nsys_cli.main([copies_db, "--views", "gpu_activities,cuda_api_sum", "--out", str(out),
                          "--json", str(js), "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "GPU activities" in text and "cuda_api_sum" in text and "Kernels of step" not in text
    assert "[CUDA memcpy DtoD]" in text
    doc = json.loads((out / "views.json").read_text())
    assert set(doc["views"]) >= {"gpu_activities", "nvtx_kern_sum", "user_ranges",
                                 "cuda_gpu_mem_size_sum"}
    assert (out / "views" / "cuda_gpu_mem_time_sum.csv").read_text().startswith("Time (%),Total "
                                                                                "Time (ns),Count")
    # the JSON file re-renders through the report tool, every view the same as the import's own
    assert report_cli.main([str(js), "--views", "all"]) == 0
    again = capsys.readouterr().out
    _, roof, _ = report.read_json(str(js))
    assert roof.device == "H100 SXM" and again == V.render_views(nsys_views(copies_db), roof,
                                                                 V.VIEWS, step="last")
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {ev["args"]["name"]: ev["tid"] for ev in events if ev.get("name") == "thread_name"}
    cats = {ev["cat"]: ev["tid"] for ev in events if ev.get("ph") == "X"}
    assert (cats["memcpy"] == cats["memset"] == tracks["copies and memsets"]
            and cats["api"] == tracks["CUDA API"])
    assert nsys_cli.main([copies_db, "--views", "bogus"]) == 2
    assert "--views 'bogus'" in one_error_line(capsys)
    (tmp_path / "afile").write_text("x")
    assert nsys_cli.main([copies_db, "--out", str(tmp_path / "afile")]) == 2
    assert "--out" in one_error_line(capsys)


def test_a_folder_for_the_export_is_called_a_folder(tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    with pytest.raises(nsys.NsysReportError, match="is a folder"):
        nsys.load(str(tmp_path / "adir"))
    assert nsys_cli.main([str(tmp_path / "adir")]) == 2
    err = one_error_line(capsys)
    assert "is a folder" in err and "no such file" not in err


def test_output_paths_name_the_flag_and_missing_folders_are_made(step_db, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert nsys_cli.main([step_db, "--csv", "a/b/k.csv", "--json", "c/k.json", "--trace",
                          "d/t.json", "--out", "e/f"]) == 0
    capsys.readouterr()
    assert (tmp_path / "a/b/k.csv").read_text().count("\n") == 17
    assert len(report.read_json("c/k.json")[0]) == 16 and (tmp_path / "d/t.json").is_file()
    assert (tmp_path / "e/f/views.json").is_file()
    assert not [name for folder in ("a/b", "c", "d") for name in os.listdir(tmp_path / folder)
                if ".tmp" in name]
    (tmp_path / "text.txt").write_text("x")
    for flag, path in (("--json", "text.txt/x.json"), ("--png", "text.txt/x.png"),
                       ("--out", "text.txt/sub")):
        assert nsys_cli.main([step_db, flag, path]) == 2
        assert f"{flag} {path}: text.txt is a file, not a folder" in one_error_line(capsys)
    assert nsys_cli.main([step_db, "--trace", "a"]) == 2
    assert "--trace a: is a folder" in one_error_line(capsys)

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/somewhere/.k.csv.tmp")

    monkeypatch.setattr(os, "open", denied)
    # a failed write: the run failed
    assert nsys_cli.main([step_db, "--csv", "g/k.csv"]) == 1
    err = one_error_line(capsys)
    assert "--csv g/k.csv: cannot write it ([Errno 13]" in err and ".tmp" not in err


def test_png_into_a_missing_folder(step_db, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "no" / "dir" / "x.png"
    assert nsys_cli.main([step_db, "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(path.parent) == ["x.png"]


PERCENT = re.compile(r"(-?[\d,]+\.\d+)%")


def test_an_export_without_nvtx_ranges_prints_no_percentage_above_100(tmp_path, capsys):
    """Kernels and their launch calls but no NVTX range: the user ranges' CPU percentages are of
    the API calls' host time, not of the ranges' 0 ns."""
    e = Export()
    for i, kernel in enumerate(("encoder_forward_kernel", "adamw_kernel")):
        e.launch(kernel, at=1_000 + 100 * i)
    path = e.write(tmp_path / "bare.sqlite")
    assert nsys_cli.main([path]) == 0
    out = capsys.readouterr().out
    shown = [float(p.replace(",", "")) for p in PERCENT.findall(out)]
    assert shown and max(shown) <= 100.0, out
    users = {row[0]: row for row in V.tables(nsys_views(path), "user_ranges")[0].rows}
    self_cpu, cpu_total = users["cudaLaunchKernel"][1:4:2]
    assert self_cpu == cpu_total == "100.00%"


def test_api_calls_outside_the_ranges_count_in_the_host_time(tmp_path):
    """A call before the first range (a cudaMalloc, say) is host time the ranges do not hold: the
    percentages of the user ranges are of both."""
    e = Export()
    e.launch("encoder_forward_kernel", at=100)                       # 20 ns, outside any range
    e.range("Train step 1", 1_000, 1_080)
    e.launch("adamw_kernel", at=1_010)                               # 20 ns, inside the step
    profile = nsys_views(e.write(tmp_path / "x.sqlite"))
    users = {row[0]: row for row in V.tables(profile, "user_ranges")[0].rows}
    assert users["train_step-1"][3] == "80.00%" and users["cudaLaunchKernel"][3] == "40.00%"
