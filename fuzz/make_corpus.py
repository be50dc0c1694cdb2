#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus, fuzz/corpus/<target>/: small valid files made
by the torch wheel, safetensors and Pillow (the files hddp reads from outside), and, for
fuzz_state_file, by hddp itself (the target's HDDP_FUZZ_WRITE_SEED mode).

    /opt/hddp-venv/bin/python fuzz/make_corpus.py [--state-file-target build-fuzz/fuzz_state_file]

The corpus is committed; run this again only to change it. Every file stays under 20 KB
but the state file (~27 KB: a LibTorch archive, TorchScript code included).
"""
import argparse
import collections
import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import tempfile
import zipfile

import torch
from PIL import Image
from safetensors.torch import save as safetensors_save

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    folder = os.path.join(CORPUS, target)
    os.makedirs(folder, exist_ok=True)
    # A Trainer's state file is a LibTorch archive (TorchScript code included) of ~27 KB
    # for the smallest job; every other seed stays under 20 KB.
    assert len(data) < (32 if target == "fuzz_state_file" else 20) * 1024, (target, name, len(data))
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def state_dicts():
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    base = torch.arange(6, dtype=torch.float32)
    return {
        # model.state_dict(): an OrderedDict with _metadata, num_batches_tracked (int64).
        "module": linear.state_dict(),
        "dtypes": collections.OrderedDict(
            f64=torch.tensor([1.5, -2.0], dtype=torch.float64),
            f16=torch.tensor([0.5], dtype=torch.float16),
            bf16=torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16),
            i32=torch.tensor([7, -7], dtype=torch.int32),
            i16=torch.tensor([3], dtype=torch.int16),
            i8=torch.tensor([-1], dtype=torch.int8),
            u8=torch.tensor([255], dtype=torch.uint8),
            b=torch.tensor([True, False]),
            scalar=torch.tensor(4.0),
            empty=torch.zeros(0, 3)),
        # Views of one storage (tied weights, a slice with an offset and a transpose).
        "shared": {"w": base.view(2, 3), "tied": base.view(2, 3), "tail": base[2:],
                   "t": base.view(2, 3).t()},
        "plain": {"x": torch.ones(2, 2)},
    }


def torch_save_bytes(sd):
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    return buffer.getvalue()


def state_dict_seeds():
    for name, sd in state_dicts().items():
        pt = torch_save_bytes(sd)
        put("fuzz_state_dict_pt", name + ".pt", pt)
        with zipfile.ZipFile(io.BytesIO(pt)) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            put("fuzz_pickle", name + ".pkl", z.read(pkl))
        contiguous = {k: v.contiguous().clone() for k, v in sd.items()}
        put("fuzz_state_dict_safetensors", name + ".safetensors",
            safetensors_save(contiguous, metadata={"format": "pt"}))


def idx_bytes(code, shape, payload):
    return bytes([0, 0, code, len(shape)]) + b"".join(struct.pack(">I", d) for d in shape) + payload


def idx_seeds():
    images = bytes(range(2 * 3 * 3))
    put("fuzz_idx", "images-u8.idx", idx_bytes(0x08, [2, 3, 3], images))
    put("fuzz_idx", "labels-u8.idx", idx_bytes(0x08, [2], b"\x03\x07"))
    put("fuzz_idx", "i8.idx", idx_bytes(0x09, [2], b"\xff\x01"))
    put("fuzz_idx", "i16.idx", idx_bytes(0x0B, [2, 2], struct.pack(">4h", 1, -2, 3, -4)))
    put("fuzz_idx", "i32.idx", idx_bytes(0x0C, [3], struct.pack(">3i", 1, -2, 1 << 20)))
    put("fuzz_idx", "f32.idx", idx_bytes(0x0D, [2], struct.pack(">2f", 0.5, -1.0)))
    put("fuzz_idx", "f64.idx", idx_bytes(0x0E, [1, 1], struct.pack(">d", 3.25)))
    put("fuzz_idx", "images-u8.idx.gz", gzip.compress(idx_bytes(0x08, [2, 3, 3], images), mtime=0))


def cifar_seeds():
    record = 1 + 3 * 32 * 32
    one = bytes([3]) + bytes((i * 7) % 256 for i in range(record - 1))
    put("fuzz_cifar", "one-record.bin", one)
    put("fuzz_cifar", "two-records.bin", one + bytes([9]) + bytes(record - 1))


def image_seeds():
    rgb = Image.new("RGB", (5, 4))
    rgb.putdata([(x * 50, y * 60, (x + y) * 20) for y in range(4) for x in range(5)])
    mask = Image.new("L", (4, 3))
    mask.putdata([0, 255, 255, 0, 255, 0, 0, 255, 0, 0, 255, 255])
    seeds = {
        "rgb.png": (rgb, "PNG", {}),
        "rgba.png": (rgb.convert("RGBA"), "PNG", {}),
        "mask.png": (mask, "PNG", {}),
        "palette.png": (rgb.convert("P"), "PNG", {}),
        "interlaced.png": (rgb, "PNG", {"interlace": 1}),
        "gray16.png": (mask.convert("I;16"), "PNG", {}),
        "rgb.jpg": (rgb, "JPEG", {"quality": 90}),
        "progressive.jpg": (rgb, "JPEG", {"progressive": True}),
        "gray.jpg": (mask, "JPEG", {}),
        "cmyk.jpg": (rgb.convert("CMYK"), "JPEG", {"quality": 90}),
        "rgb.bmp": (rgb, "BMP", {}),
        "rgb.tga": (rgb, "TGA", {}),
        "rle.tga": (rgb, "TGA", {"compression": "tga_rle"}),
        "rgb.gif": (rgb.convert("P"), "GIF", {}),
        "mask.pgm": (mask, "PPM", {}),
        "rgb.ppm": (rgb, "PPM", {}),
    }
    for name, (image, fmt, options) in seeds.items():
        buffer = io.BytesIO()
        image.save(buffer, fmt, **options)
        put("fuzz_image", name, buffer.getvalue())


def job_record_seeds():
    t = 1765000000.0
    events = [
        {"t": t, "event": "job", "generation": 0, "min": 2, "max": 3, "pid": 4242},
        {"t": t + 0.5, "event": "generation", "generation": 0, "slots": [0, 1, 2], "port": 29500},
        {"t": t + 2.0, "event": "started", "generation": 0, "step": 0, "repeated": 0,
         "commits": "/tmp/job/commits"},
        {"t": t + 2.5, "event": "first_step", "generation": 0, "step": 1},
        {"t": t + 5.0, "event": "commit", "generation": 0, "step": 10, "file": "state-00000010.hddp"},
        {"t": t + 6.0, "event": "unplug", "generation": 0, "slot": 2},
        {"t": t + 6.1, "event": "left", "generation": 0, "slot": 2, "why": "exit code 1"},
        {"t": t + 6.2, "event": "reform", "generation": 0},
        {"t": t + 7.0, "event": "generation", "generation": 1, "slots": [0, 1], "port": 29501},
        {"t": t + 8.0, "event": "resumed", "generation": 1, "step": 10, "repeated": 2,
         "commits": "/tmp/job/commits"},
        {"t": t + 8.5, "event": "first_step", "generation": 1, "step": 11},
        {"t": t + 9.0, "event": "back", "generation": 1, "slots": [2]},
        {"t": t + 12.0, "event": "end", "generation": 1, "code": 0, "why": "finished"},
    ]
    lines = "".join(json.dumps(e) + "\n" for e in events)
    put("fuzz_job_record", "elastic.jsonl", lines.encode())
    put("fuzz_job_record", "torn-last-line.jsonl", (lines + '{"t": 1765000013, "eve').encode())
    put("fuzz_job_record", "job-only.jsonl", (json.dumps(events[0]) + "\n").encode())


def launch_seeds():
    envs = {
        "torchrun.env": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                         "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                         "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "job-7",
                         "TORCHELASTIC_USE_AGENT_STORE": "True"},
        "hddp-run.env": {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "localhost", "MASTER_PORT": "29400",
                         "HDDP_LAUNCHER": "hddp-run", "HDDP_LAUNCHER_RUN_ID": "hddp-12",
                         "TORCHELASTIC_RUN_ID": "hddp-12", "HDDP_RANK_PREFIXED": "1",
                         "HDDP_ELASTIC": "1", "HDDP_SLOT": "2", "HDDP_SLOTS": "0,2",
                         "HDDP_SLOT_COUNT": "3", "HDDP_ELASTIC_DIR": "/tmp/job"},
        "slurm.env": {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                      "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[01-02,07],login1",
                      "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "123456",
                      "SLURM_RESTART_COUNT": "2"},
        "slurm-one-node.env": {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                               "SLURM_JOB_NUM_NODES": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5",
                               "SLURM_JOB_ID": "77"},
        "openmpi.env": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                        "MASTER_ADDR": "node1", "MASTER_PORT": "29500"},
        "progress-marks.env": {"progress.slot2": "", "progress.slot123456": "x"},
    }
    for name, env in envs.items():
        put("fuzz_launch_protocol", name, "".join(f"{k}={v}\n" for k, v in env.items()).encode())
    put("fuzz_launch_protocol", "progress-mark.bin", struct.pack("<qq", 123456789, 42))


def planner_file_seeds():
    with open(os.path.join(HERE, "..", "data", "devices.json"), "rb") as f:
        put("fuzz_device_table", "devices.json", f.read())
    table = {"devices": {"mygpu": {"name": "My GPU", "fp32_tflops": 20.0, "fp16_tflops": 80.0,
                                   "bf16_tflops": 0, "memory_gib": 12, "memory_GBps": 500,
                                   "source": "datasheet"}},
             "links": {"myx4": {"name": "PCIe 3.0 x4", "GBps": 3.2, "source": "measured"}}}
    put("fuzz_device_table", "small.json", json.dumps(table).encode())
    profile = {"model": "resnet18 3x32x32", "forward_flops_per_sample": 1.1e9,
               "train_flops_per_sample": 3.3e9, "activation_bytes_per_sample": 2.5e6,
               "parameter_bytes": 4.5e7, "input_bytes_per_sample": 12288, "amp": "bf16",
               "gradient_shapes": [[64, 3, 3, 3], [64], [10, 512], [10]],
               "calibration": {"device": "rtx3060", "seconds_per_sample": 0.0004,
                               "fixed_seconds": 0.01}}
    put("fuzz_model_profile", "resnet18.json", json.dumps(profile, indent=1).encode())
    del profile["gradient_shapes"], profile["calibration"]
    profile["amp"] = "off"
    put("fuzz_model_profile", "plain.json", json.dumps(profile).encode())


def state_file_seeds(target):
    with tempfile.TemporaryDirectory() as dir:
        subprocess.run([target], env=dict(os.environ, HDDP_FUZZ_WRITE_SEED=dir), check=True)
        for name in sorted(os.listdir(dir)):
            with open(os.path.join(dir, name), "rb") as f:
                put("fuzz_state_file", name, f.read())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-file-target", default=os.path.join(HERE, "..", "build-fuzz",
                                                                    "fuzz_state_file"))
    args = parser.parse_args()
    for target in os.listdir(CORPUS) if os.path.isdir(CORPUS) else []:
        if target != "fuzz_state_file" or os.path.exists(args.state_file_target):
            shutil.rmtree(os.path.join(CORPUS, target))
    state_dict_seeds()
    idx_seeds()
    cifar_seeds()
    image_seeds()
    job_record_seeds()
    launch_seeds()
    planner_file_seeds()
    if os.path.exists(args.state_file_target):
        state_file_seeds(args.state_file_target)
    else:
        print(f"{args.state_file_target} not built: fuzz_state_file's seeds left as they are")


if __name__ == "__main__":
    main()
