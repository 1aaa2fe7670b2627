"""The NVML adapter's pure parts, and its behaviour on a box without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cosyvoice_lb.launcher.plan.gpu import GpuReading, gpu_readings, inventory, process_gpu_memory, visible_indexes

UUIDS = ["GPU-8932f937-aaaa", "GPU-1a2b3c4d-bbbb", "GPU-8932f000-cccc"]


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, [0, 1, 2]),
        ("", [0, 1, 2]),
        ("2,0", [2, 0]),
        ("1", [1]),
        ("GPU-1a2b", [1]),
        ("GPU-1a2b3c4d-bbbb,0", [1, 0]),
        ("0,7,1", [0]),  # CUDA stops at the first entry it cannot resolve
        ("GPU-8932f", []),  # ambiguous prefix
        ("0,0,1", [0, 1]),
        ("MIG-abcd", []),
    ],
)
def test_visible_indexes_follow_cuda_visible_devices(value, expected):
    assert visible_indexes(UUIDS, value) == expected


def test_inventory_without_a_gpu_says_why_and_has_the_host():
    box = inventory()
    assert box.gpus == () and box.source.startswith("none")
    assert box.cpu_cores >= 1 and box.ram_total >= box.ram_available > 0


def test_inventory_for_a_hypothetical_box():
    box = inventory("24GiB, 12GiB")
    assert [(g.index, g.total, g.free) for g in box.gpus] == [(0, 24 * 2**30, 24 * 2**30), (1, 12 * 2**30, 12 * 2**30)]
    assert box.source == "--gpus"


# --- telemetry through a fake NVML --------------------------------------------------------


class FakeNvml:
    """Stands in for the pynvml module: two cards, the second without a power reading."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # pynvml's own names
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    NVML_TEMPERATURE_GPU = 0
    CARDS = [
        {
            "uuid": b"GPU-aaaa-0000",
            "name": b"NVIDIA H100 80GB HBM3",
            "used": 20 * 2**30,
            "total": 80 * 2**30,
            "util": 37,
            "temp": 54,
            "power": 312_500,
            "procs": [(4242, 5 * 2**30), (999, 2**30)],
        },
        {
            "uuid": "GPU-bbbb-1111",
            "name": "NVIDIA A10",
            "used": 2**30,
            "total": 24 * 2**30,
            "util": 0,
            "temp": 41,
            "power": None,
            "procs": [(4242, 2**30), (4343, None)],
        },
    ]

    def __init__(self, init_error=None, list_error=None, shutdown_error=None):
        self.init_error, self.list_error, self.shutdown_error = init_error, list_error, shutdown_error
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        if self.shutdown_error:
            raise self.shutdown_error

    def nvmlDeviceGetCount(self):
        if self.list_error:
            raise self.list_error
        return len(self.CARDS)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.CARDS[index]

    def nvmlDeviceGetUUID(self, handle):
        return handle["uuid"]

    def nvmlDeviceGetName(self, handle):
        return handle["name"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=handle["used"], total=handle["total"], free=handle["total"] - handle["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return handle["temp"]

    def nvmlDeviceGetPowerUsage(self, handle):
        if handle["power"] is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return handle["power"]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle["procs"]]


def test_gpu_readings_reads_every_card_and_keeps_what_one_cannot_tell(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    first, second = gpu_readings(nvml)
    assert first == GpuReading(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-aaaa-0000",
        memory_used=20 * 2**30,
        memory_total=80 * 2**30,
        utilization=0.37,
        temperature=54.0,
        power=312.5,
    )
    # power is not supported there: None, and the other readings are still there
    assert (second.index, second.name, second.uuid) == (1, "NVIDIA A10", "GPU-bbbb-1111")
    assert (second.utilization, second.temperature, second.power) == (0.0, 41.0, None)
    assert second.as_dict()["power"] is None and second.as_dict()["memory_total"] == 24 * 2**30
    assert nvml.calls == ["init", "shutdown"]


@pytest.mark.parametrize("value, expected", [("1", [1]), ("GPU-aaaa", [0]), ("1,0", [1, 0]), ("", [0, 1])])
def test_gpu_readings_follow_cuda_visible_devices(monkeypatch, value, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert [g.index for g in gpu_readings(FakeNvml())] == expected


def test_gpu_readings_are_absent_without_a_driver_or_on_an_error():
    no_driver = FakeNvml(init_error=FakeNvml.NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    assert gpu_readings(no_driver) == ()
    assert no_driver.calls == ["init"]  # nothing to shut down after a failed init
    broken = FakeNvml(list_error=FakeNvml.NVMLError("Unknown Error"))
    assert gpu_readings(broken) == ()
    assert broken.calls == ["init", "shutdown"]
    # a shutdown that fails does not lose what was read
    assert len(gpu_readings(FakeNvml(shutdown_error=FakeNvml.NVMLError("Uninitialized")))) == 2


def test_gpu_readings_on_this_box_without_a_gpu():
    assert gpu_readings() == ()


def test_process_gpu_memory_sums_over_cards_for_the_pids_asked():
    nvml = FakeNvml()
    assert process_gpu_memory({4242, 4343}, nvml) == {4242: 6 * 2**30}  # 4343's memory is unknown (None)
    assert nvml.calls == ["init", "shutdown"]
    assert process_gpu_memory({4242}, FakeNvml(init_error=FakeNvml.NVMLError("no driver"))) == {}
    assert process_gpu_memory({4242}) == {}  # the real NVML here: no GPU
