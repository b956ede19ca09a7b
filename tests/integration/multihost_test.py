#!/usr/bin/env python3
"""Data parallel across hosts, with network namespaces standing in for them: two namespaces on a
bridge of veth pairs, each with its own address and host name, `keel launch --hostfile` starting
one rank in each through a launch agent that enters the namespace where ssh would log in (Open
MPI over TCP between them). The run gives the losses of the same run on one host; a host that
disappears mid-run (its link down, its processes killed) ends the job within comm_timeout_s with a
message naming the host and rank, and the run resumes from its last checkpoint.

Needs root and iproute2 (`ip netns`); exits 77 (ctest: skipped, said) where namespaces cannot be
made.

    $(scripts/python-env.sh) tests/integration/multihost_test.py KEEL
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import FAILURES, check, run_tests, write_data, write_recipe_file  # noqa: E402

KEEL = os.path.abspath(sys.argv[1])
WORK = tempfile.mkdtemp(prefix="keel_multihost_test_")
DATA = os.path.join(WORK, "train.jsonl")
TAG = "%04d" % (os.getpid() % 10000)  # names and addresses of this run's namespaces
SUBNET = "10.%d.%d" % (100 + os.getpid() % 100, os.getpid() // 100 % 250)
BRIDGE = "kbr" + TAG
HOSTS = [("keel%s-a" % TAG, SUBNET + ".2"), ("keel%s-b" % TAG, SUBNET + ".3")]
AGENT = os.path.join(WORK, "netns_agent.sh")
HOSTFILE = os.path.join(WORK, "hosts")
COMM_TIMEOUT_S = 10


def sh(*cmd, ok=False):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0 and not ok:
        raise RuntimeError("%s: %s" % (" ".join(cmd), r.stderr.strip()))
    return r


def make_hosts():
    """The bridge, one namespace per host joined to it by a veth pair, and the launch agent. The
    bridge has an address too: mpirun runs outside the namespaces, where the launch node would."""
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", SUBNET + ".1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for i, (ns, addr) in enumerate(HOSTS):
        outside, inside = "kv%s%d" % (TAG, i), "kv%s%dp" % (TAG, i)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        sh("ip", "link", "set", inside, "netns", ns)
        sh("ip", "link", "set", outside, "master", BRIDGE)
        sh("ip", "link", "set", outside, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", addr + "/24", "dev", inside)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    # What ssh would do: run the command on HOST, here in its namespace under its own host name,
    # from a client that stays outside it. Open MPI calls it as AGENT [options] HOST COMMAND... A
    # client whose remote side was killed stays silent, as ssh does when the host's link is down
    # (nothing reaches it to say so): losing the host must be noticed by the job itself.
    cases = "".join('  %s) ns=%s ;;\n' % (addr, ns) for ns, addr in HOSTS)
    with open(AGENT, "w") as f:
        f.write('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nhost=$1; shift\ncase $host in\n%s'
                '  *) echo "netns agent: unknown host $host" >&2; exit 1 ;;\nesac\n'
                'ip netns exec "$ns" unshare --uts sh -c "hostname $ns; $*" &\nwait $!\nstatus=$?\n'
                '[ $status -gt 128 ] && while :; do sleep 1; done\nexit $status\n' % cases)
    os.chmod(AGENT, 0o755)
    with open(HOSTFILE, "w") as f:
        f.write("".join("%s slots=1\n" % addr for _, addr in HOSTS))


def remove_hosts():
    sh("pkill", "-f", AGENT, ok=True)  # the agents of lost hosts, silent outside the namespaces
    for ns, _ in HOSTS:
        for pid in sh("ip", "netns", "pids", ns, ok=True).stdout.split():
            sh("kill", "-9", pid, ok=True)
        sh("ip", "netns", "del", ns, ok=True)
    sh("ip", "link", "del", BRIDGE, ok=True)


def write_recipe(name, **overrides):
    keys = {"data_path": DATA, "output_dir": os.path.join(WORK, name), "dtype": "fp32", "max_seq_len": 16,
            "batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "warmup_steps": 1,
            "max_steps": 6, "seed": 11, "shuffle": True, "max_grad_norm": 0.5, "log_interval": 1, "dp_degree": 2,
            "comm_timeout_s": COMM_TIMEOUT_S, "checkpoint_dir": os.path.join(WORK, name, "ck"), "save_interval": 2}
    keys.update(overrides)
    model = {"family": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2}
    return write_recipe_file(os.path.join(WORK, name + ".toml"), keys, model)


def launch_across_hosts(recipe, *extra):
    return [KEEL, "launch", "-n", "2", "--hostfile", HOSTFILE, "--launch-agent", AGENT, "--network",
            SUBNET + ".0/24", recipe] + list(extra)


def losses(name):
    with open(os.path.join(WORK, name, "metrics.jsonl")) as f:
        return [json.loads(l)["loss"] for l in f if l.strip()]


def test_two_hosts_train_as_one():
    one = subprocess.run([KEEL, "launch", "-n", "2", write_recipe("one_host")], capture_output=True, text=True,
                         timeout=300)
    two = subprocess.run(launch_across_hosts(write_recipe("two_hosts")), capture_output=True, text=True, timeout=300)
    if not (check(one.returncode == 0, "two ranks on one host (%s)" % (one.stdout + one.stderr)[-600:]) and
            check(two.returncode == 0, "one rank on each of two hosts (%s)" % (two.stdout + two.stderr)[-800:])):
        return
    check("2 hosts: %s, %s" % (HOSTS[0][0], HOSTS[1][0]) in two.stdout,
          "the run says it spans the two hosts (%s)" % [l for l in two.stdout.splitlines() if "data parallel" in l])
    a, b = losses("one_host"), losses("two_hosts")
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if len(a) == len(b) == 6 else float("inf")
    check(worst <= 1e-6, "the two-host run's losses are the one-host run's (worst %.2e)" % worst)


def test_lost_host_ends_the_job_and_the_run_resumes():
    recipe = write_recipe("lost", max_steps=400, save_interval=1)
    metrics = os.path.join(WORK, "lost", "metrics.jsonl")
    # Output to a file, not a pipe: the lost host's silent agent keeps mpirun's outputs open.
    log_path = os.path.join(WORK, "lost.log")
    log = open(log_path, "w")
    job = subprocess.Popen(launch_across_hosts(recipe), stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not os.path.exists(metrics) or len(open(metrics).read().splitlines()) < 3):
        time.sleep(0.2)
    if not check(job.poll() is None and os.path.exists(metrics), "the job trains across the hosts"):
        job.kill()
        return
    # The second host disappears: its link goes down, then everything running on it is killed.
    lost_ns = HOSTS[1][0]
    sh("ip", "netns", "exec", lost_ns, "ip", "link", "set", "kv%s1p" % TAG, "down")
    for pid in sh("ip", "netns", "pids", lost_ns, ok=True).stdout.split():
        sh("kill", "-9", pid, ok=True)
    lost_at = time.time()
    try:
        job.wait(timeout=COMM_TIMEOUT_S + 50)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
    took = time.time() - lost_at
    log.close()
    out = open(log_path).read()
    check(job.returncode not in (0, None), "the job fails (exit %s)" % job.returncode)
    check(took <= COMM_TIMEOUT_S + 20, "it ends %.1f s after the host was lost (comm_timeout_s = %d)" %
          (took, COMM_TIMEOUT_S))
    named = [l for l in out.splitlines() if "did not complete" in l]
    check(any(("rank 1 on %s" % lost_ns) in l for l in named),
          "the message names the lost host and its rank (%s)" % (named or out[-600:]))
    print("  the job ended %.1f s after the host was lost: %s" % (took, named[-1] if named else "(no message)"))
    # The host is back: the run resumes from its last checkpoint across both hosts.
    sh("ip", "netns", "exec", lost_ns, "ip", "link", "set", "kv%s1p" % TAG, "up")
    done = len(open(metrics).read().splitlines())
    r = subprocess.run(launch_across_hosts(recipe, "--set", "max_steps=%d" % (done + 2), "--resume", "auto"),
                       capture_output=True, text=True, timeout=300)
    check(r.returncode == 0 and "resumed from" in r.stdout,
          "the run resumes from its last checkpoint (%s)" % (r.stdout + r.stderr)[-600:])


def main():
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare") or not shutil.which("mpirun"):
        print("SKIP: needs root, iproute2's ip, unshare and mpirun to make network namespaces")
        sys.exit(77)
    try:
        make_hosts()
    except RuntimeError as e:
        remove_hosts()
        print("SKIP: this machine cannot make network namespaces joined by veth pairs: %s" % e)
        sys.exit(77)
    write_data(DATA, 120, seed=3, vocab=40, lo=4, hi=24)
    try:
        run_tests(globals(), "multi-host", WORK, FAILURES)
    finally:
        remove_hosts()


if __name__ == "__main__":
    main()
