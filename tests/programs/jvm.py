"""A JVM service (Debian's default-jdk-headless), for the program tests: a
small Java HTTP server, compiled by the test, with a counter map in memory, a
pool of 32 worker threads started at once, and a hot method the JIT compiles.

GET /inc/KEY counts KEY; GET / answers the state. Each request runs
``Counter.work`` (``Counter.coldN`` for GET /coldN, N 1 or 2); the JVM prints its
compilations (-XX:+PrintCompilation), so a test sees whether a method had to
be compiled again after a restore, and that the log still gets them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = """
import com.sun.net.httpserver.HttpServer;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.ThreadPoolExecutor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

public class Counter {
    static final ConcurrentHashMap<String, AtomicLong> counts = new ConcurrentHashMap<>();

    static long work(int n) {
        long s = 0;
        for (int i = 0; i < n; i++) s += (i * 31L) ^ (s >>> 3);
        return s;
    }

    // First called after a restore (one for each): their compiles are logged.
    static long cold1(int n) {
        long s = 1;
        for (int i = 0; i < n; i++) s = s * 17 + (i ^ (s >>> 5));
        return s;
    }

    static long cold2(int n) {
        long s = 3;
        for (int i = 0; i < n; i++) s = s * 13 + (i ^ (s >>> 7));
        return s;
    }

    public static void main(String[] args) throws Exception {
        String host = args.length > 1 ? args[1] : "127.0.0.1";
        InetSocketAddress at = new InetSocketAddress(host, Integer.parseInt(args[0]));
        HttpServer server = HttpServer.create(at, 64);
        ThreadPoolExecutor pool = new ThreadPoolExecutor(
            32, 32, 1, TimeUnit.HOURS, new LinkedBlockingQueue<>());
        pool.prestartAllCoreThreads();
        server.setExecutor(pool);
        server.createContext("/", ex -> {
            String path = ex.getRequestURI().getPath();
            long t0 = System.nanoTime();
            long w = path.startsWith("/cold1") ? cold1(100_000)
                : path.startsWith("/cold2") ? cold2(100_000) : work(100_000);
            long ns = System.nanoTime() - t0;
            if (path.startsWith("/inc/"))
                counts.computeIfAbsent(path.substring(5), k -> new AtomicLong()).incrementAndGet();
            StringBuilder b = new StringBuilder("{\\"counts\\":{");
            String sep = "";
            for (Map.Entry<String, AtomicLong> e : new TreeMap<>(counts).entrySet()) {
                b.append(sep).append('"').append(e.getKey()).append("\\":").append(e.getValue().get());
                sep = ",";
            }
            b.append("},\\"work_ns\\":").append(ns).append(",\\"w\\":").append(w).append('}');
            byte[] out = b.toString().getBytes();
            ex.getResponseHeaders().set("Content-Type", "application/json");
            ex.sendResponseHeaders(200, out.length);
            try (OutputStream o = ex.getResponseBody()) { o.write(out); }
        });
        server.start();
        System.out.println("listening");
    }
}
"""

WORK = re.compile(r"^.*Counter::work .*$", re.M)
def cold(n: int) -> re.Pattern[str]:
    """The JIT's lines about Counter.coldN."""
    return re.compile(rf"^.*Counter::cold{n} .*$", re.M)


def compile_server(out: Path) -> Path:
    javac = shutil.which("javac")
    if javac is None:
        pytest.fail("javac is missing: `make setup` installs Debian's default-jdk-headless")
    out.mkdir(parents=True, exist_ok=True)
    (out / "Counter.java").write_text(SOURCE)
    subprocess.run([javac, "-d", str(out), str(out / "Counter.java")], check=True,
                   capture_output=True, timeout=120)
    return out


def java_cmd(classes: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    java = shutil.which("java")
    assert java
    return [java, "-XX:+PrintCompilation", "-Xmx128m", "-cp", str(classes), "Counter",
            str(port), host]


def work_fully_compiled(log: str) -> bool:
    """Has C2 (tier 4) compiled Counter.work as a method (not only a loop of
    it, on-stack replacement, `%`)? Until then more calls compile it again."""
    for line in WORK.findall(log):
        parts = line.split()
        at = parts.index("Counter::work")
        if parts[at - 1] == "4" and "%" not in parts[2:at - 1] and "made not" not in line:
            return True
    return False


def compilations_of_work(log: str) -> list[str]:
    """The JIT's lines about Counter.work (each tier, and any deoptimization)."""
    return WORK.findall(log)
