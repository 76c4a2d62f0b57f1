"""The process side: CRIU (criu.py, images streamed to it: imagestream.py,
its image files read: criuimages.py, a dump checked whole: wholedump.py,
a stopped CRIU continued: unstop.py),
a process tree (tree.py), its sockets and the network lock (sockets.py,
netlock.py), the TIME_WAIT a same-host restore waits out (timewait.py),
its /dev/shm links (linkremap.py), reaping local jobs (reaper.py) and the
io_uring filter (seccomp.py). Stands on smr.contract only."""
