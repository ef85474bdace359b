"""Ports for the tests' own stores and process groups.

A port probed with bind(0) comes from the kernel's ephemeral range, which every concurrent test's
outgoing connections also draw from, and it is free only for the probe: Megatron-Bridge's in-process
restart then opens MASTER_PORT + 1 and + 2, and nvidia-resiliency-ext's store, finding its port taken,
quietly turns client of whatever listens there and waits. So: a run of consecutive ports below the
ephemeral range, each checked free, picked at random so that concurrent tests rarely try the same.
"""
import random
import socket


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count=1, attempts=200):
    """The first of `count` consecutive ports on 127.0.0.1 that are all free now."""
    high = min(_ephemeral_low(), 65536) - count
    for _ in range(attempts):
        base = random.randrange(10000, high)
        try:
            probes = []
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                probes.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in probes:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found in {attempts} attempts")
