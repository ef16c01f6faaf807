"""`make bench-gpu`: the GPU baseline: the machine's limits and tensorkv's GPU routes, one run.

    python bench/gpu.py [--quick] [--out-dir bench-results]

Limits of the machine, measured in this run at 64 MiB (medians after a warm-up): a
device-to-device copy, pinned and pageable host-to-device (H2D) and device-to-host (D2H)
copies, each timed with CUDA events on a stream of its own (CuPy, cupy.cuda.runtime), and a
host memcpy (NumPy, wall clock). GB/s of a copy: bytes copied per second.

Rows: push+pull of one float32 key of 16 floats, 4 MiB and 64 MiB, dist_sync, one worker
(this process), against a real `python -m tensorkv_server` on 127.0.0.1 (one per server
device, started once), one per route GPU values take: CuPy values and torch CUDA tensors to
the GPU server over CUDA IPC (the same-host default), over shared memory pinned on both ends
(CUDA IPC turned off in the worker's sessions) and with transport='tcp'; NumPy worker -> GPU
server and NumPy worker -> CPU server for reference; then Adam set on the server, 64 MiB
push+pull from CuPy and NumPy workers to a GPU server and from a NumPy worker to a CPU one.
Each row names the route its store took (read from its sessions after its calls).
A GPU worker's round trip ends when its device has the pulled value (synchronized). GB/s
counts the payload both ways (2 x size / round trip, as bench/run.py). "x 4 pinned" is a
64 MiB row's fraction of four pinned crossings (worker D2H, server H2D, server D2H, worker
H2D at the measured pinned rates: the bound of a route that stages through host memory);
"x device copy" its fraction of the measured device-to-device copy rate.

Then ResNet-50 training steps on the GPU server (bench/resnet_step.py): torch's own SGD step
(batch 64 x 3 x 224 x 224) next to the same step through tensorkv.Trainer over each route
(CUDA IPC, pinned shared memory, TCP), as a ratio to the local step beside issue 34's goals
(<= 1.2x over CUDA IPC, <= 1.6x over pinned shared memory), each Trainer step checked
against torch's SGD fed the same gradients.

Every round trip pushes one of two patterns alternately into a pull target filled with -1,
and the pulled value is checked off the clock; an Adam row's last pull is checked against
the same steps on the embedded NumPy store. A row that fails is reported and the run goes on;
the results are written, then it exits 2 if a value was wrong, 1 if a row failed otherwise.
The whole run is stopped after RUN_LIMIT seconds (exit 1); every server is stopped by its PID.
Without CuPy seeing a CUDA device (or without torch's CUDA for the torch and ResNet-50
rows) the GPU rows are skipped with one line saying why, and the CPU rows (host memcpy, NumPy
worker -> CPU server, Adam on a CPU server) are still measured: a CPU-only mode, never a GPU
number.
Writes <out-dir>/gpu.{json,md} (gpu-quick.* with --quick: fewer repeats).
"""
import contextlib
import datetime
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import common
import resnet_step
from gpu_routes import ROOT, open_store, route, started_server
from run import CheckError, _check, _patterns, machine

MiB = 1 << 20
BIG = 64 * MiB
SIZES = (("16 floats", 64), ("4 MiB", 4 * MiB), ("64 MiB", BIG))  # (label, bytes)
# repeats (quick, full) of each size's round trips, of an Adam row and of a limit's copies
REPEATS = {64: (30, 200), 4 * MiB: (3, 20), BIG: (3, 10), "adam": (3, 7), "limit": (3, 10)}
WARMUP = 2  # untimed round trips (copies) first
RUN_LIMIT = 480  # seconds the whole run gets (SIGALRM), a bound far above what it should take (and under 10 minutes)
GPU_SERVER, CPU_SERVER = "GPU server", "CPU server"


# ---- the GPU and its limits ----------------------------------------------------------

def gpu_or_why():
    """(cupy, None) when CuPy sees a CUDA device, else (None, why not)."""
    try:
        import cupy
    except Exception as error:  # noqa: BLE001 (not installed, or broken)
        return None, f"CuPy does not import ({type(error).__name__}: {error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 (no driver)
        return None, f"CuPy sees no CUDA device ({type(error).__name__}: {error})"
    return (cupy, None) if count > 0 else (None, "CuPy sees no CUDA device")


def torch_cuda_or_why():
    """(torch, None) when torch imports and sees CUDA, else (None, why not)."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001
        return None, f"torch does not import ({type(error).__name__}: {error})"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    return torch, None


def gpu_facts(cupy):
    """The GPU's name and the CuPy, CUDA runtime and driver versions."""
    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return {"gpu": name.decode() if isinstance(name, bytes) else str(name), "cupy": cupy.__version__,
            "cuda_runtime": _cuda_version(runtime.runtimeGetVersion()),
            "cuda_driver": _cuda_version(runtime.driverGetVersion()), "driver": _nvidia_driver()}


def _cuda_version(number):
    return f"{number // 1000}.{number % 1000 // 10}"


def _nvidia_driver():
    """The NVIDIA driver's version from nvidia-smi, or None."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return None


def event_median(cupy, copy, repeats):
    """Median seconds of ``copy(stream)`` (queued on ``stream``) between two CUDA events, after
    WARMUP untimed copies."""
    stream = cupy.cuda.Stream(non_blocking=True)
    for _ in range(WARMUP):
        copy(stream)
    stream.synchronize()
    seconds = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        copy(stream)
        end.record(stream)
        end.synchronize()
        seconds.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(seconds)


def gpu_limits(cupy, repeats, size=BIG):
    """GB/s of a device copy and of pinned and pageable H2D and D2H copies of ``size`` bytes,
    each checked (the bytes arrive)."""
    runtime = cupy.cuda.runtime
    pattern = byte_pattern(size)
    device_a, device_b = cupy.asarray(pattern), cupy.empty(size, cupy.uint8)
    pinned = cupyx_empty_pinned(cupy, size)
    pageable = np.empty(size, np.uint8)

    def memcpy(dst, src, kind):
        return lambda stream: runtime.memcpyAsync(dst, src, size, kind, stream.ptr)

    d2d = memcpy(device_b.data.ptr, device_a.data.ptr, runtime.memcpyDeviceToDevice)
    copies = [
        ("device copy", d2d, device_b),
        ("pinned D2H", memcpy(pinned.ctypes.data, device_a.data.ptr, runtime.memcpyDeviceToHost), pinned),
        ("pinned H2D", memcpy(device_b.data.ptr, pinned.ctypes.data, runtime.memcpyHostToDevice), device_b),
        ("pageable D2H", memcpy(pageable.ctypes.data, device_a.data.ptr, runtime.memcpyDeviceToHost), pageable),
        ("pageable H2D", memcpy(device_b.data.ptr, pageable.ctypes.data, runtime.memcpyHostToDevice), device_b),
    ]
    rates = {}
    for name, copy, target in copies:
        target.fill(0)
        cupy.cuda.Device().synchronize()  # the fill ran on the default stream, the copies do not
        rates[name] = size / event_median(cupy, copy, repeats) / 1e9
        got = target if isinstance(target, np.ndarray) else cupy.asnumpy(target)
        if not np.array_equal(got, pattern):
            raise CheckError(f"{name} of {size} bytes: the bytes copied differ from the source")
    return rates


def cupyx_empty_pinned(cupy, size):
    """A NumPy array of ``size`` bytes in pinned (page-locked) host memory."""
    import cupyx
    return cupyx.empty_pinned((size,), np.uint8)


def byte_pattern(size):
    """``size`` bytes 0, 1, ..., 250, 0, 1, ... (no page of it is all one value)."""
    return np.resize(np.arange(251, dtype=np.uint8), size)


def host_memcpy(repeats, size=BIG):
    """GB/s of a host memcpy of ``size`` bytes (NumPy copyto, wall clock), checked."""
    src = byte_pattern(size)
    dst = np.zeros(size, np.uint8)
    seconds = common.median_time(lambda: np.copyto(dst, src), repeats, WARMUP)
    if not np.array_equal(dst, src):
        raise CheckError("host memcpy: the bytes copied differ from the source")
    return size / seconds / 1e9


# ---- round trips ---------------------------------------------------------------------

class Values:
    """How one kind of worker values is made, synchronized and read back: NumPy arrays, CuPy
    arrays or torch CUDA tensors."""

    def __init__(self, kind, module=None):
        self.kind, self.module = kind, module

    def array(self, host):
        if self.kind == "numpy":
            return host.copy()
        if self.kind == "cupy":
            return self.module.asarray(host)
        return self.module.from_numpy(host).to("cuda")

    def sync(self):
        """Wait until the device has done what was queued (a pull's value is there)."""
        if self.kind == "cupy":
            self.module.cuda.Device().synchronize()
        elif self.kind == "torch":
            self.module.cuda.synchronize()

    def host(self, value):
        if self.kind == "numpy":
            return value
        if self.kind == "cupy":
            return self.module.asnumpy(value)
        return value.cpu().numpy()

    def fill(self, value, number):
        if self.kind == "torch":
            value.fill_(number)
        else:
            value.fill(number)


def round_trip_medians(kv, values, repeats_of, first_key):
    """{size label: median seconds} of push+pull of one float32 key per size (keys from
    ``first_key``), each round trip's pull checked off the clock."""
    medians = {}
    for offset, (label, size) in enumerate(SIZES):
        n = size // 4
        key = first_key + offset
        hosts, expected = _patterns(n)
        pushed = [values.array(h) for h in hosts]
        out = values.array(np.zeros(n, np.float32))
        kv.init(key, pushed[0])
        seconds = []
        for i in range(WARMUP + repeats_of(size)):
            values.fill(out, -1.0)  # so a partial pull cannot pass for a full one
            values.sync()
            start = time.perf_counter()
            kv.push(key, pushed[i % 2])
            kv.pull(key, out=out)
            values.sync()
            elapsed = time.perf_counter() - start
            _check(f"{values.kind} key {key} ({label}) push+pull #{i}", values.host(out), expected[i % 2])
            if i >= WARMUP:
                seconds.append(elapsed)
        medians[label] = statistics.median(seconds)
    return medians


def adam_median(kv, values, repeats, key=900):
    """Median seconds of a 64 MiB push+pull with Adam set on the server; the last pull checked
    against the same steps on the embedded NumPy store."""
    import tensorkv
    n = BIG // 4
    index = np.arange(n, dtype=np.int64)
    weight = ((index % 2003) / 1001.0 - 1.0).astype(np.float32)  # in [-1, 1]
    grad = ((index % 1009) / 5040.0 - 0.1).astype(np.float32)  # in [-0.1, 0.1]
    kv.set_optimizer(tensorkv.optimizer.Adam(learning_rate=0.001))
    kv.init(key, values.array(weight))
    pushed, out = values.array(grad), values.array(np.zeros(n, np.float32))
    seconds = []
    for i in range(WARMUP + repeats):
        values.sync()
        start = time.perf_counter()
        kv.push(key, pushed)
        kv.pull(key, out=out)
        values.sync()
        if i >= WARMUP:
            seconds.append(time.perf_counter() - start)
    with tensorkv.create("local") as reference:
        reference.set_optimizer(tensorkv.optimizer.Adam(learning_rate=0.001))
        reference.init(key, weight)
        for _ in range(WARMUP + repeats):
            reference.push(key, grad)
        want = reference.pull(key).astype(np.float64)
    got = values.host(out).astype(np.float64)
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        worst = int(np.argmax(np.abs(got - want)))
        raise CheckError(f"Adam, {values.kind} key {key}, after {WARMUP + repeats} steps: element {worst} "
                         f"is {got[worst]}, expected {want[worst]}")
    return statistics.median(seconds)


# ---- the run -------------------------------------------------------------------------

# (row, server, worker values, transport): the push+pull rows, in the order, then a
# row per route of GPU values ('pinned': open_store)
ROWS = [
    ("CuPy worker -> GPU server", GPU_SERVER, "cupy", "auto"),
    ("NumPy worker -> GPU server", GPU_SERVER, "numpy", "auto"),
    ("NumPy worker -> CPU server", CPU_SERVER, "numpy", "auto"),
    ("CuPy worker -> GPU server, transport='tcp'", GPU_SERVER, "cupy", "tcp"),
    ("torch CUDA tensors -> GPU server", GPU_SERVER, "torch", "auto"),
    ("CuPy worker -> GPU server, pinned shared memory", GPU_SERVER, "cupy", "pinned"),
    ("torch CUDA tensors -> GPU server, pinned shared memory", GPU_SERVER, "torch", "pinned"),
    ("torch CUDA tensors -> GPU server, transport='tcp'", GPU_SERVER, "torch", "tcp"),
]
ADAM_ROWS = [
    ("Adam 64 MiB: CuPy worker -> GPU server", GPU_SERVER, "cupy"),
    ("Adam 64 MiB: NumPy worker -> GPU server", GPU_SERVER, "numpy"),
    ("Adam 64 MiB: NumPy worker -> CPU server", CPU_SERVER, "numpy"),
]


def measure(quick, logdir, say):
    """Everything the run measures, as a dict; ``say`` reports progress and skips. A row that
    fails (a wrong value: "check"; anything else: "error") is kept in "failures" and the run
    goes on with the next one, so that one run still gives every other row."""
    pick = 0 if quick else 1
    result = {"limits_gbps": {}, "rows": [], "adam": [], "skipped": [], "failures": []}

    def attempt(what, fn):
        try:
            return fn()
        except CheckError as error:
            failure = {"row": what, "kind": "check", "error": str(error)}
        except Exception as error:  # noqa: BLE001 (reported, and the run exits 1)
            failure = {"row": what, "kind": "error", "error": f"{type(error).__name__}: {error}"}
        say(f"  {what} FAILED ({failure['kind']}): {one_line(failure['error'])}")
        result["failures"].append(failure)
        return None

    cupy, no_gpu = gpu_or_why()
    torch, no_torch = torch_cuda_or_why() if cupy is not None else (None, no_gpu)
    if no_gpu:
        line = f"GPU rows skipped: {no_gpu}; CPU-only mode, measuring the CPU rows alone"
        say(line)
        result["skipped"].append(line)
    else:
        result["gpu"] = gpu_facts(cupy)
        say(f"GPU: {result['gpu']['gpu']}; measuring the limits")
        result["limits_gbps"].update(attempt("GPU limits", lambda: gpu_limits(cupy, REPEATS["limit"][pick])) or {})
    memcpy = attempt("host memcpy", lambda: host_memcpy(REPEATS["limit"][pick]))
    if memcpy is not None:
        result["limits_gbps"]["host memcpy"] = memcpy
    values = {"numpy": Values("numpy"), "cupy": Values("cupy", cupy), "torch": Values("torch", torch)}
    why_not = {"cupy": no_gpu, "torch": no_torch, "numpy": None}
    if no_torch and not no_gpu:  # without a GPU the one line above says it
        line = f"torch rows skipped: {no_torch}"
        say(line)
        result["skipped"].append(line)

    def plain_row(address, server_name, index, row, kind, transport):
        with open_store(address, transport) as kv:
            medians = round_trip_medians(kv, values[kind], lambda size: REPEATS[size][pick], 100 * index)
            result["rows"].append({"row": row, "server": server_name, "worker": kind, "transport": transport,
                                   "route": route(kv), "ms": {label: s * 1e3 for label, s in medians.items()},
                                   "pulls_checked": {label: WARMUP + REPEATS[size][pick] for label, size in SIZES}})
        say(f"  {row}: " + ", ".join(f"{label} {s * 1e3:.2f} ms" for label, s in medians.items()))

    def adam_row(address, server_name, row, kind):
        with open_store(address) as kv:
            seconds = adam_median(kv, values[kind], REPEATS["adam"][pick])
            result["adam"].append({"row": row, "server": server_name, "worker": kind, "route": route(kv),
                                   "ms": seconds * 1e3, "steps_checked": WARMUP + REPEATS["adam"][pick]})
        say(f"  {row}: {seconds * 1e3:.2f} ms")

    def server_rows(server_name, device):
        with started_server(device, logdir) as address:
            say(f"{server_name} (--device {device}) at {address}")
            for index, (row, where, kind, transport) in enumerate(ROWS):
                if where == server_name and not why_not[kind]:
                    attempt(row, lambda: plain_row(address, server_name, index, row, kind, transport))
            for row, where, kind in ADAM_ROWS:
                if where == server_name and not why_not[kind]:
                    attempt(row, lambda: adam_row(address, server_name, row, kind))
            if server_name == GPU_SERVER and not why_not["torch"]:
                result["resnet"] = resnet_step.measure(torch, "cuda", address, "quick" if quick else "full", say,
                                                       attempt)

    for server_name, device in ((GPU_SERVER, "cuda"), (CPU_SERVER, "cpu")):
        if server_name != GPU_SERVER or not no_gpu:
            attempt(server_name, lambda: server_rows(server_name, device))
    return result


def bounds(limits):
    """(GB/s of four pinned crossings, GB/s of a device copy) from the limits, or None each."""
    four = None
    if "pinned H2D" in limits and "pinned D2H" in limits:
        # push: worker D2H + server H2D; pull: server D2H + worker H2D; 2 x size moved in all
        seconds_per_byte = 2 / limits["pinned D2H"] + 2 / limits["pinned H2D"]
        four = 2 / seconds_per_byte
    return four, limits.get("device copy")


def annotate(result):
    """Add GB/s and the fractions of the bounds to each 64 MiB row."""
    four, device = bounds(result["limits_gbps"])
    result["four_pinned_gbps"] = four
    for row in result["rows"] + result["adam"]:
        ms = row["ms"]["64 MiB"] if isinstance(row["ms"], dict) else row["ms"]
        row["gbps_64MiB"] = 2 * BIG / (ms / 1e3) / 1e9
        row["x_four_pinned"] = row["gbps_64MiB"] / four if four else None
        row["x_device_copy"] = row["gbps_64MiB"] / device if device else None
    by_name = {row["row"]: row["ms"] for row in result["adam"]}
    gpu, cpu = by_name.get(ADAM_ROWS[1][0]), by_name.get(ADAM_ROWS[2][0])
    result["adam_cpu_over_gpu"] = cpu / gpu if gpu and cpu else None


def one_line(text):
    """A failure's first and last lines (a server's log tail in between is in the JSON)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else text


def _ms(value):
    return f"{value:.3f} ms" if value < 1 else f"{value:.1f} ms"


def _x(value):
    return "—" if value is None else f"{value:.3f}"


def markdown(result, command):
    facts = result.get("gpu", {})
    lines = [
        f"`{command}` on {result['date']}, commit {result['commit']}",
        "",
        f"Machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs "
        f"({result['machine']['cpu'] or '?'}), Python "
        f"{result['machine']['python']}, NumPy {result['machine']['numpy']}, grpcio {result['machine']['grpcio']}; "
        + (f"GPU {facts['gpu']}, CuPy {facts['cupy']}, CUDA runtime {facts['cuda_runtime']}, driver "
           f"{facts['driver'] or '?'} (CUDA {facts['cuda_driver']}); torch {result.get('torch') or '—'}"
           if facts else "no GPU (CPU-only mode)") + ".",
        "",
    ]
    lines += [f"- {line}" for line in result["skipped"]]
    lines += [f"- **{f['row']} FAILED** ({'wrong value' if f['kind'] == 'check' else 'error'}): "
              f"{one_line(f['error'])}"
              for f in result["failures"]]
    if result["skipped"] or result["failures"]:
        lines.append("")
    lines += ["| limit, 64 MiB, medians | GB/s |", "| --- | ---: |"]
    lines += [f"| {name} | {rate:.2f} |" for name, rate in result["limits_gbps"].items()]
    if result["four_pinned_gbps"]:
        lines.append(f"| four pinned crossings (64 MiB push+pull bound) | {result['four_pinned_gbps']:.2f} |")
    lines += ["", "GB/s: 2 x 64 MiB / round trip, the payload counted both ways as bench/run.py counts it "
              "(issue 34's table counts it once: half these). x 4 pinned: the row's fraction of four pinned "
              "crossings at the pinned rates above; x device copy: of the device copy's rate.",
              "", "| same host, 1 worker, dist_sync, medians | route | 16 floats | 4 MiB | 64 MiB push+pull "
              "| 64 MiB GB/s | x 4 pinned | x device copy |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        cells = [_ms(row["ms"][label]) for label, _ in SIZES]
        lines.append(f"| {row['row']} | {row['route']} | {' | '.join(cells)} | {row['gbps_64MiB']:.2f} "
                     f"| {_x(row['x_four_pinned'])} | {_x(row['x_device_copy'])} |")
    if result["adam"]:
        lines += ["", "| Adam set on the server, 64 MiB push+pull, medians | route | ms | GB/s |",
                  "| --- | --- | ---: | ---: |"]
        lines += [f"| {row['row']} | {row['route']} | {row['ms']:.1f} | {row['gbps_64MiB']:.2f} |"
                  for row in result["adam"]]
        if result["adam_cpu_over_gpu"]:
            lines.append(f"\nAdam, NumPy worker: CPU server / GPU server = {result['adam_cpu_over_gpu']:.2f}x")
    if result.get("resnet"):
        lines += ["", *resnet_step.markdown(result["resnet"])]
    return "\n".join(lines) + "\n"


def cpu_model():
    """The processor's model name (/proc/cpuinfo), else platform.processor()."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or None


def commit():
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0:
            return out.stdout.strip()
    return "unknown"


class RunTimeLimit(BaseException):
    """The run's RUN_LIMIT passed (a BaseException: no row's failure handler catches it)."""


def _alarm(signum, frame):
    raise RunTimeLimit(f"bench/gpu.py did not finish within {RUN_LIMIT} s")


def main(argv=None):
    args = common.parse_args(__doc__, argv)
    command = "python bench/gpu.py" + (" --quick" if args.quick else "")
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(RUN_LIMIT)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as logdir:
            result = measure(args.quick, logdir,
                             lambda line: print(f"[{time.monotonic() - started:5.1f} s] {line}", flush=True))
    except RunTimeLimit as error:
        print(f"gpu bench FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    torch, _ = torch_cuda_or_why() if "gpu" in result else (None, None)
    result.update(command=command, commit=commit(), machine={**machine(), "cpu": cpu_model()},
                  torch=torch and torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  seconds=time.monotonic() - started, quick=args.quick)
    annotate(result)
    common.write_results(args, "gpu", markdown(result, command), result)
    kinds = {failure["kind"] for failure in result["failures"]}
    if kinds:
        print(f"gpu bench FAILED: {len(result['failures'])} row(s) failed"
              + (": a pulled value was wrong" if "check" in kinds else ""), file=sys.stderr)
    return 2 if "check" in kinds else 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
