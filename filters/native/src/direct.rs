//! The module's own connections to the sidecar (issue 41 part 2, decision 219): a stream's calls
//! go out on connections the module holds, instead of one Envoy callout each.
//!
//! Envoy's async HTTP client costs Envoy ~140 k instructions a decision (a new HTTP/2 stream
//! through its connection pool, router and codec on the worker thread). Here a few threads of the
//! module's own each hold one keep-alive HTTP/1.1 connection to `sidecar.address` and take calls
//! from one queue: a call is written as one request and its answer read whole (blocking, with the
//! call's deadline on every read and write). A thread answers one call at a time, so a slow
//! decision holds back none of the others' [`THREADS`]. The answer is handed to the stream through
//! its [`Link`]: stored, then the stream's scheduler wakes its worker thread
//! (`on_http_filter_scheduled`), where the core takes it as it takes a callout's.
//!
//! Decision calls that queued while the threads were busy leave together (decision 225): the
//! thread that takes the first takes every waiting decision call that joins it
//! (`call_batch::joins`) and sends them as one `POST /v1/decide/batch`, whose answer it splits
//! back into one answer per call. A call is queued with a wake-up only when the queue was empty,
//! so under load the calls that arrive while a thread wakes ride its batch: one wake, one write
//! and one read for all of them, instead of each. A call that waits alone goes alone. With
//! `sidecar.batchDecisions: false`, every call goes alone and wakes a thread, as before.
//!
//! Failure is what a callout's is: a call that gets no whole answer within its timeout (the
//! sidecar down, hung, or the connection lost or frozen) is answered "failed" and the core applies
//! the failure mode. The connection it was on is closed (a late answer would be read as the next
//! call's), and the thread's next call opens another. A kept connection is looked at before use:
//! one the sidecar closed meanwhile (restarted, or idle) is replaced, and one idle for [`IDLE`]
//! is closed rather than raced against the sidecar's own idle close (10 s).

use crate::ffi::Filter;
use crate::scheduler::StreamScheduler;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use crate::ffi;
use crate::host::Ids;
use tollgate_filter_core::call_batch;
use tollgate_filter_core::host::CallSpec;
use tollgate_filter_core::stats::Metric;
use tollgate_filter_core::sidecar::SidecarAddress;
use tollgate_filter_core::sidecar_http1::{read_response, request};

/// Threads (and so connections, and calls at once) per configuration.
const THREADS: usize = 8;
/// A connection unused this long is closed before its next call (below the sidecar's 10 s).
const IDLE: Duration = Duration::from_secs(5);

pub use tollgate_filter_core::sidecar_http1::Answer;

/// How a call's answer came: alone, or in a batch (`first`: the batch's first call, which counts
/// the batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rode {
    Alone,
    Batch { first: bool },
}

struct Job {
    call: CallSpec,
    reply: Box<dyn FnOnce(Answer, Rode) + Send>,
}

#[derive(Default)]
struct Queue {
    jobs: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
    /// Waiting decision calls leave as one batch (`sidecar.batchDecisions`, on by default).
    batch: bool,
}

/// The connections' owner: calls are handed to its threads. Dropped (its configuration gone),
/// its threads answer what is queued as failed and stop.
pub struct Direct {
    queue: Arc<Queue>,
}

impl Direct {
    /// Starts the threads; each connects at its first call. `batch`: decision calls that wait
    /// together leave as one batch.
    pub fn start(address: SidecarAddress, batch: bool) -> std::io::Result<Direct> {
        let queue = Arc::new(Queue { batch, ..Queue::default() });
        for i in 0..THREADS {
            let (queue, address) = (queue.clone(), address.clone());
            std::thread::Builder::new().name(format!("tollgate-sc-{i}")).spawn(move || serve(&queue, &address))?;
        }
        Ok(Direct { queue })
    }

    /// Queues `call`; `reply` gets its answer on one of the connections' threads. A thread is
    /// woken only for a call that finds the queue empty: the calls after it, until a thread
    /// takes them, are taken with it.
    pub fn send(&self, call: CallSpec, reply: impl FnOnce(Answer, Rode) + Send + 'static) {
        let mut jobs = self.queue.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let wake = jobs.0.is_empty() || !self.queue.batch;
        jobs.0.push_back(Job { call, reply: Box::new(reply) });
        drop(jobs);
        if wake {
            self.queue.ready.notify_one();
        }
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.queue.jobs.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.queue.ready.notify_all();
    }
}

/// A connection to the sidecar, TCP or unix.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn open(address: &SidecarAddress, within: Duration) -> std::io::Result<Conn> {
        Ok(match address {
            SidecarAddress::Tcp(a) => {
                let s = TcpStream::connect_timeout(a, within)?;
                s.set_nodelay(true)?;
                Conn::Tcp(s)
            }
            SidecarAddress::Unix(path) => Conn::Unix(UnixStream::connect(path)?),
        })
    }

    /// Whether the peer has neither closed this idle connection nor sent anything on it (a
    /// read that would block). Bytes read here are discarded with the connection.
    fn open_still(&mut self, scratch: &mut [u8]) -> bool {
        let nonblocking = |c: &Conn, on: bool| match c {
            Conn::Tcp(s) => s.set_nonblocking(on),
            Conn::Unix(s) => s.set_nonblocking(on),
        };
        if nonblocking(self, true).is_err() {
            return false;
        }
        let idle = matches!(self.read(scratch), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        nonblocking(self, false).is_ok() && idle
    }

    /// The deadline's remainder on the next read and write (`None`: it passed).
    fn until(&self, deadline: Instant) -> Option<()> {
        let left = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        let set = match self {
            Conn::Tcp(s) => s.set_read_timeout(Some(left)).and_then(|()| s.set_write_timeout(Some(left))),
            Conn::Unix(s) => s.set_read_timeout(Some(left)).and_then(|()| s.set_write_timeout(Some(left))),
        };
        set.ok()
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One thread: takes calls until the queue is closed and empty.
fn serve(queue: &Queue, address: &SidecarAddress) {
    let mut conn: Option<(Conn, Instant)> = None;
    // the thread's read buffer, zeroed once (zeroing 8 KiB per call was a sixth of its cost)
    let mut scratch = vec![0u8; 8192];
    loop {
        let (taken, more) = {
            let mut jobs = queue.jobs.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                let taken = match queue.batch {
                    true => call_batch::take(&mut jobs.0, |j: &Job| &j.call),
                    false => jobs.0.pop_front().into_iter().collect(),
                };
                if !taken.is_empty() {
                    break (taken, !jobs.0.is_empty());
                }
                if jobs.1 {
                    return;
                }
                jobs = queue.ready.wait(jobs).unwrap_or_else(|p| p.into_inner());
            }
        };
        if more {
            // what this thread left (calls that do not join its batch) is another's
            queue.ready.notify_one();
        }
        let n = taken.len();
        let calls: Vec<&CallSpec> = if n > 1 { taken.iter().map(|j| &j.call).collect() } else { Vec::new() };
        let Some(batch) = call_batch::join(&calls) else {
            for job in taken {
                let deadline = Instant::now() + job.call.timeout;
                let answer = call(&mut conn, address, &job.call, deadline, &mut scratch);
                (job.reply)(answer.unwrap_or((None, Vec::new())), Rode::Alone);
            }
            continue;
        };
        let deadline = Instant::now() + batch.timeout;
        let answer = call(&mut conn, address, &batch, deadline, &mut scratch).unwrap_or((None, Vec::new()));
        for (i, (job, answer)) in taken.into_iter().zip(call_batch::split(answer, n)).enumerate() {
            (job.reply)(answer, Rode::Batch { first: i == 0 });
        }
    }
}

/// One call on the thread's connection (opened first if there is none, or it idled): on any
/// failure the connection is dropped.
fn call(slot: &mut Option<(Conn, Instant)>, address: &SidecarAddress, spec: &CallSpec, deadline: Instant, scratch: &mut [u8]) -> Option<Answer> {
    let request = request(spec)?;
    // a kept connection the sidecar closed meanwhile (idle, restarted) is not used: its close
    // is waiting to be read
    let kept = slot.take().and_then(|(mut c, used)| (used.elapsed() < IDLE && c.open_still(scratch)).then_some(c));
    let mut conn = match kept {
        Some(c) => c,
        None => Conn::open(address, deadline.checked_duration_since(Instant::now())?).ok()?,
    };
    conn.until(deadline)?;
    conn.write_all(&request).ok()?;
    let (answer, keep) = read_response(&mut conn, scratch)?;
    if keep {
        *slot = Some((conn, Instant::now()));
    }
    Some(answer)
}

/// A stream's side of its direct calls: the answers in, and the scheduler that wakes the stream
/// for them. Shared by the stream and its calls in flight; the last one drops the scheduler.
pub struct Link {
    scheduler: StreamScheduler,
    answers: Mutex<Vec<(u32, Answer, Rode)>>,
    next: AtomicU32,
}

/// Direct calls are numbered from here: apart from Envoy's callout ids (1 up).
const FIRST_ID: u32 = 1 << 31;

impl Link {
    /// For the stream of the current hook.
    pub fn new(filter: Filter) -> Option<Link> {
        Some(Link { scheduler: StreamScheduler::new(filter)?, answers: Mutex::default(), next: AtomicU32::new(FIRST_ID) })
    }

    pub fn next_id(&self) -> u32 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The answer to call `id` is in: kept, and the stream woken (on its worker thread).
    pub fn answer(&self, id: u32, answer: Answer, rode: Rode) {
        self.answers.lock().unwrap_or_else(|p| p.into_inner()).push((id, answer, rode));
        self.scheduler.commit(0);
    }

    /// The answers in since the last take, in stream `filter`'s hook: the batches they rode are
    /// counted as the core counts its own (`decisions.batched`, `decision_batches`).
    pub fn take(&self, filter: Filter, ids: &Ids) -> Vec<(u32, Answer, Rode)> {
        let answers = std::mem::take(&mut *self.answers.lock().unwrap_or_else(|p| p.into_inner()));
        let count = |metric| {
            if let Some(&id) = ids.metrics.get(&metric) {
                ffi::increment_counter(filter, id, 1);
            }
        };
        for rode in answers.iter().map(|a| a.2) {
            if let Rode::Batch { first } = rode {
                count(Metric::DecisionsBatched);
                if first {
                    count(Metric::DecisionBatches);
                }
            }
        }
        answers
    }
}
