//! One filter configuration in the native host: a core `Worker` per Envoy worker thread, their
//! streams, their tick.
//!
//! Wasm gives each Envoy worker a VM of its own; here one [`Plugin`] per configuration holds one
//! [`Slot`] per worker thread (decision 221; the straight port, decision 252, had one lock for all
//! of them): a slot's state — the core's `Worker` and each of its streams' `HttpFilter`, which
//! share `Rc`s — is reached only under that slot's lock. So the core stays single-threaded code,
//! unchanged: the lock is what makes its `Rc`s and `RefCell`s sound across threads (`Guarded`
//! below), and workers no longer wait on each other's requests, only on their own slot's tick.
//! Like VMs, the slots share what the core keeps in shared data (crate::shared).
//!
//! - requests: each stream's hooks run on its worker thread, under its slot's lock. The first
//!   worker thread to make a stream takes the slot made with the configuration; another gets a
//!   new one (the configuration parsed again, its seeds its own);
//! - the tick: a thread of the plugin's wakes Envoy's main thread through the configuration's
//!   scheduler every tick period; every slot's jobs run there, each under its lock, and their
//!   calls go out as configuration callouts (answered on the main thread, to the slot that sent
//!   them). The period is the one the workers need now, as the Wasm host sets it (decision 272:
//!   the lease tick only while leases are in use);
//! - Envoy re-entering the module: a hook that runs while its thread already holds the lock (an
//!   answer Envoy delivers inside the call that sent it) is queued and run once the lock is
//!   released; replies and resumes are made after the lock is released (crate::host::After).
//!
//! Failure mode: a panic inside the core (caught) fails that request closed, 503
//! `gateway_unavailable`, as the Wasm host answers for a failed VM (docs/operations.md).

use crate::direct::{Direct, Link};
use crate::ffi::{self, Config, Filter, Level, ModulePtr, Phase, Status, CONTINUE, STOP, STOP_WATERMARK};
use crate::scheduler::Scheduler;
use crate::host::{After, Ids, NativeHost};
use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};
use std::time::Duration;
use std::thread::JoinHandle;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::{Action, Host};
use tollgate_filter_core::http::HttpFilter;
use tollgate_filter_core::worker::{Seeds, Worker};

/// The body of the 503 a request gets when the filter failed on it.
const UNAVAILABLE: &[u8] = br#"{"error":"gateway_unavailable","message":"the gateway cannot decide this request now; retry"}"#;

/// Single-threaded state made sendable: every access happens under its [`Slot`]'s lock.
struct Guarded<T>(T);
// SAFETY: a `Guarded` value (and every `Rc` it shares with a stream's `HttpFilter`, itself only
// touched under the same lock) is reached by one thread at a time, the lock ordering them.
unsafe impl<T> Send for Guarded<T> {}

struct State {
    worker: Worker,
    /// Its calls in flight through its own configuration (the tick's and their answers' calls).
    out: HashSet<u64>,
    /// Calls it sent that Envoy cancelled with their configuration, answered nothing: each is
    /// given a failed answer at its next tick, so what it carried is sent again (decision 254).
    orphans: Vec<u64>,
}

/// One worker thread's core (a Wasm VM's counterpart), under its own lock.
struct Slot {
    state: Mutex<Guarded<State>>,
}

pub struct Plugin {
    config: Config,
    serial: u64, // this configuration's number in the process ([`MINE`])
    /// The configuration as Envoy gave it (each new slot parses it: `FilterConfig` is `Rc`'d).
    bytes: Vec<u8>,
    /// The counters this configuration defined (fixed once it is made).
    ids: Ids,
    /// Its slots, one per worker thread; the first is made with the configuration.
    slots: Mutex<Vec<Arc<Slot>>>,
    /// The first slot was given to a worker thread.
    first_taken: AtomicBool,
    ticker: Mutex<Option<Ticker>>,
    /// The tick thread's period (ms): the shortest any worker needs now.
    period_ms: Arc<AtomicU64>,
    /// The module's own connection to the sidecar (`sidecar.address`; decision 219): the
    /// streams' calls go out on it; without it, as Envoy callouts.
    direct: Option<Direct>,
}

/// The thread that wakes the main thread every tick period; it hands the scheduler back when it
/// stops, so that the main thread deletes it.
struct Ticker {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<Scheduler>,
}

/// One request's filter.
struct Stream {
    plugin: Arc<Plugin>,
    /// Its worker thread's slot: the filter is touched only under its lock.
    slot: Arc<Slot>,
    filter: Option<Guarded<HttpFilter>>,
    /// The filter failed on this request (a panic): it answered 503 and stays out of the way.
    failed: bool,
    /// Its calls' answers from the module's own connection (made at its first such call).
    link: RefCell<Option<Arc<Link>>>,
}

thread_local! {
    /// This thread holds a plugin's lock (some hook of ours runs below us on the stack).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// Hooks Envoy ran while this thread held the lock, to run once it is released.
    static LATER: RefCell<Vec<Box<dyn FnOnce()>>> = RefCell::new(Vec::new());
    /// This thread's slot of each configuration it served, by the configuration's serial.
    static MINE: RefCell<Vec<(u64, Weak<Slot>)>> = const { RefCell::new(Vec::new()) };
}

/// The serial of the next configuration.
static SERIAL: AtomicU64 = AtomicU64::new(0);

/// Resets [`INSIDE`] however the locked section ends (a panic included).
struct Inside;
impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|i| i.set(false));
    }
}

fn inside() -> bool {
    INSIDE.with(Cell::get)
}

/// Runs `hook` later, when this thread leaves the plugin (it is inside now).
fn later(hook: impl FnOnce() + 'static) {
    LATER.with(|l| l.borrow_mut().push(Box::new(hook)));
}

/// Runs the hooks queued while this thread held the lock.
fn run_later() {
    while let Some(hook) = LATER.with(|l| l.borrow_mut().pop()) {
        hook();
    }
}

impl Slot {
    /// A worker's slot, its seeds its own (as a VM's are).
    fn new(config: Config, parsed: Rc<FilterConfig>) -> Arc<Slot> {
        let seeds = Seeds { decision_ids: tollgate_filter_core::ids::random_seed(), usage_ids: identity(), hints_owner: identity(), routes_owner: identity(), changes_owner: identity() };
        let worker = Worker::new(&mut NativeHost::config(config, &Ids::default()), parsed, seeds);
        Arc::new(Slot { state: Mutex::new(Guarded(State { worker, out: HashSet::new(), orphans: Vec::new() })) })
    }

    /// Runs `f` on the state under the lock (`None`: this thread is inside already).
    fn locked<R>(&self, f: impl FnOnce(&mut State) -> R) -> Option<R> {
        if inside() {
            return None;
        }
        INSIDE.with(|i| i.set(true));
        let _inside = Inside;
        // a panic under the lock left the state as the core left it (its RefCells released)
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(f(&mut state.0))
    }
}

impl Plugin {
    /// This worker thread's slot ([`MINE`]: no lock another worker takes), else it is given one.
    fn slot(&self) -> Option<Arc<Slot>> {
        if let Some(mine) = MINE.with(|m| m.borrow().iter().find(|(n, _)| *n == self.serial).and_then(|(_, w)| w.upgrade())) {
            return Some(mine);
        }
        let slot = self.give()?;
        MINE.with(|m| {
            let mut m = m.borrow_mut();
            m.retain(|(_, w)| w.strong_count() > 0); // the slots of configurations gone since
            m.push((self.serial, Arc::downgrade(&slot)));
        });
        Some(slot)
    }

    /// A slot for a worker thread that has none of this configuration yet.
    fn give(&self) -> Option<Arc<Slot>> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if !self.first_taken.swap(true, Ordering::Relaxed) {
            return slots.first().cloned();
        }
        // Envoy checked the configuration when it was made (config_new): it parses again
        let slot = Slot::new(self.config, Rc::new(FilterConfig::parse(&self.bytes).ok()?));
        slots.push(slot.clone());
        ffi::log(Level::Info, &format!("tollgate: a worker thread's filter state made ({} in this configuration)", slots.len()));
        Some(slot)
    }

    /// Every slot (a copy: the list's lock is not held while a slot's is taken).
    fn all_slots(&self) -> Vec<Arc<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn stop_ticker(&self) {
        let ticker = self.ticker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = ticker {
            let _ = t.stop.send(());
            // the scheduler is deleted here, on the main thread, once its thread stopped
            drop(t.thread.join());
        }
    }
}

/// The plugin behind a configuration pointer, without taking Envoy's reference.
///
/// # Safety
/// `module` is a pointer [`config_new`] returned and Envoy has not destroyed.
unsafe fn plugin(module: ModulePtr) -> Arc<Plugin> {
    // SAFETY: per the caller's contract, an `Arc::into_raw` still counted once.
    let held = ManuallyDrop::new(unsafe { Arc::from_raw(module.cast::<Plugin>()) });
    Arc::clone(&held)
}

/// A period in whole milliseconds, at least 1.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn identity() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::process::id())
}

pub fn config_new(config: Config, bytes: &[u8]) -> ModulePtr {
    let parsed = match FilterConfig::parse(bytes) {
        Ok(c) => Rc::new(c),
        Err(e) => {
            ffi::log(Level::Error, &e.to_string());
            return std::ptr::null();
        }
    };
    let (address, batch) = (parsed.sidecar.address.clone(), parsed.sidecar.batch_decisions);
    let first = Slot::new(config, parsed);
    let define = |name: &str| ffi::define_counter(config, name);
    let defined = first.locked(|s| {
        let ids = Ids {
            metrics: s.worker.metrics().into_iter().filter_map(|m| define(&m.name()).map(|id| (m, id))).collect(),
            named: s.worker.named_metrics().into_iter().filter_map(|n| define(&n).map(|id| (n, id))).collect(),
        };
        (ids, s.worker.tick_period())
    });
    let Some((ids, period)) = defined else { return std::ptr::null() };
    let direct = match address.map(|a| Direct::start(a, batch)) {
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => {
            ffi::log(Level::Error, &format!("tollgate: cannot start the sidecar connection's thread: {e}"));
            return std::ptr::null();
        }
        None => None,
    };
    let slots = Mutex::new(vec![first]);
    let period_ms = Arc::new(AtomicU64::new(millis(period)));
    let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
    let plugin = Arc::new(Plugin { config, serial, bytes: bytes.to_vec(), ids, slots, first_taken: AtomicBool::new(false), ticker: Mutex::new(None), period_ms: period_ms.clone(), direct });
    let Some(scheduler) = Scheduler::new(config) else {
        ffi::log(Level::Error, "tollgate: Envoy gave no scheduler for the filter's tick");
        return std::ptr::null();
    };
    let (stop, stopped) = mpsc::channel::<()>();
    let spawned = std::thread::Builder::new().name("tollgate-tick".into()).spawn(move || {
        // the tick's timer: a wait that ends early only to stop
        while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(Duration::from_millis(period_ms.load(Ordering::Relaxed))) {
            scheduler.commit(0);
        }
        scheduler
    });
    match spawned {
        Ok(thread) => *plugin.ticker.lock().unwrap_or_else(|p| p.into_inner()) = Some(Ticker { stop, thread }),
        Err(e) => {
            ffi::log(Level::Error, &format!("tollgate: cannot start the tick thread: {e}"));
            return std::ptr::null();
        }
    }
    Arc::into_raw(plugin).cast()
}

/// Envoy destroys the configuration (after every stream of it ended): the tick stops. A slot's
/// worker that still holds queued items (usage events, completions, refunds, responses) is kept, and
/// the ticks of the configurations still alive send them, for at most the core's grace
/// (`END_GRACE`, decision 156); with none alive (Envoy stopping), they are lost (decision 254).
pub fn config_destroy(module: ModulePtr) {
    if module.is_null() {
        return;
    }
    // SAFETY: Envoy destroys a configuration once: this takes back its reference.
    let plugin = unsafe { Arc::from_raw(module.cast::<Plugin>()) };
    plugin.stop_ticker();
    let config = plugin.config;
    // Envoy cancels this configuration's calls without an answer: theirs are failed later
    let cancelled: Vec<(u64, Arc<Slot>)> = {
        let mut calls = adopted_calls();
        let ids: Vec<(usize, u64)> = calls.keys().filter(|(c, _)| *c == config.key()).copied().collect();
        ids.into_iter().filter_map(|k| calls.remove(&k).map(|p| (k.1, p))).collect()
    };
    for (id, old) in cancelled {
        old.locked(|s| s.orphans.push(id));
    }
    for slot in plugin.all_slots() {
        let done = slot.locked(|s| {
            s.orphans.extend(s.out.drain());
            s.worker.end(&mut NativeHost::config(config, &plugin.ids))
        });
        if done == Some(false) {
            ending().push(slot);
        }
    }
}

/// Every slot's tick, on the main thread; then the ticks of ended configurations' workers that
/// still hold queued items (decision 254), their calls sent through this configuration.
pub fn tick(module: ModulePtr) {
    // SAFETY: Envoy calls the configuration's hooks while it lives.
    let plugin = unsafe { plugin(module) };
    if inside() {
        return;
    }
    let config = plugin.config;
    // the next period: the shortest one a worker needs after its tick
    let mut next = u64::MAX;
    for slot in plugin.all_slots() {
        slot.locked(|s| {
            let mut host = NativeHost::config(config, &plugin.ids);
            // batching is off in this host (nothing to deliver)
            drop(s.worker.on_tick(&mut host));
            next = next.min(millis(s.worker.tick_period_now(host.now_ms())));
            s.out.extend(host.sent);
        });
    }
    let waiting: Vec<Arc<Slot>> = ending().clone();
    for old in waiting {
        let ended = adopted(&old, &plugin, |s, host| {
            for id in std::mem::take(&mut s.orphans) {
                drop(s.worker.on_call_response(host, id as u32, None, Vec::new));
            }
            drop(s.worker.on_tick(host));
            next = next.min(millis(s.worker.tick_period_now(host.now_ms())));
            s.worker.has_ended()
        });
        if ended == Some(true) {
            ending().retain(|p| !Arc::ptr_eq(p, &old));
        }
    }
    if next != u64::MAX {
        plugin.period_ms.store(next, Ordering::Relaxed);
    }
    run_later();
}

/// Workers of configurations Envoy destroyed while they still held queued items.
static ENDING: Mutex<Vec<Arc<Slot>>> = Mutex::new(Vec::new());
/// Which ended configuration's worker sent a call, by the configuration it went out through and
/// its id there.
type Adopted = HashMap<(usize, u64), Arc<Slot>>;
static ADOPTED: LazyLock<Mutex<Adopted>> = LazyLock::new(Mutex::default);

fn ending() -> MutexGuard<'static, Vec<Arc<Slot>>> {
    ENDING.lock().unwrap_or_else(|p| p.into_inner())
}

fn adopted_calls() -> MutexGuard<'static, Adopted> {
    ADOPTED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on an ended configuration's worker, its calls going out through `through` (a live
/// configuration, on the main thread) and counted under that one's counters of the same names.
fn adopted<R>(old: &Arc<Slot>, through: &Plugin, f: impl FnOnce(&mut State, &mut NativeHost) -> R) -> Option<R> {
    let (result, sent) = old.locked(|s| {
        let mut host = NativeHost::config(through.config, &through.ids);
        let r = f(s, &mut host);
        (r, host.sent)
    })?;
    let mut calls = adopted_calls();
    for id in sent {
        calls.insert((through.config.key(), id), old.clone());
    }
    Some(result)
}

/// The answer to a call the worker's jobs sent.
pub fn config_call_done(module: ModulePtr, id: u64, status: Option<u16>, body: Vec<u8>) {
    // SAFETY: Envoy calls the configuration's hooks while it lives.
    let plugin = unsafe { plugin(module) };
    if inside() {
        later(move || deliver_config(&plugin, id, status, body));
        return;
    }
    deliver_config(&plugin, id, status, body);
    run_later();
}

fn deliver_config(plugin: &Arc<Plugin>, id: u64, status: Option<u16>, body: Vec<u8>) {
    let config = plugin.config;
    let owner = adopted_calls().remove(&(config.key(), id));
    if let Some(old) = owner {
        adopted(&old, plugin, |s, host| drop(s.worker.on_call_response(host, id as u32, status, || body)));
        return;
    }
    // the slot that sent it (an unknown id — cancelled meanwhile — is no one's)
    let mut body = Some(body);
    for slot in plugin.all_slots() {
        let delivered = slot.locked(|s| {
            if !s.out.remove(&id) {
                return false;
            }
            let mut host = NativeHost::config(config, &plugin.ids);
            let body = body.take().unwrap_or_default();
            drop(s.worker.on_call_response(&mut host, id as u32, status, || body));
            s.out.extend(host.sent);
            true
        });
        if delivered != Some(false) {
            return;
        }
    }
}

pub fn filter_new(module: ModulePtr, _filter: Filter) -> ModulePtr {
    // SAFETY: Envoy creates filters only from a live configuration.
    let plugin = unsafe { plugin(module) };
    let Some(slot) = plugin.slot() else { return std::ptr::null() };
    let Some(filter) = slot.locked(|s| Guarded(s.worker.request())) else {
        return std::ptr::null();
    };
    Box::into_raw(Box::new(Stream { plugin, slot, filter: Some(filter), failed: false, link: RefCell::new(None) })).cast()
}

/// # Safety
/// `module` is a pointer [`filter_new`] returned and Envoy has not destroyed.
unsafe fn stream<'a>(module: ModulePtr) -> &'a mut Stream {
    // SAFETY: per the caller's contract; Envoy runs one stream's hooks one at a time.
    unsafe { &mut *(module as *mut Stream) }
}

/// Makes the calls a hook collected, its lock released.
fn apply(filter: Filter, after: Vec<After>) {
    for a in after {
        match a {
            After::Reply { status, headers, body } => ffi::send_response(filter, status, &headers, &body, "tollgate"),
            After::ContinueDecoding => ffi::continue_decoding(filter),
            After::ContinueEncoding => ffi::continue_encoding(filter),
        }
    }
}

fn status_of(phase: Phase, action: Action) -> Status {
    match (action, phase) {
        (Action::Continue, _) => CONTINUE,
        (Action::Hold, Phase::RequestBody(_) | Phase::ResponseBody(_)) => STOP_WATERMARK,
        (Action::Pause | Action::Hold, _) => STOP,
    }
}

/// A stream callback: the filter decides, under the lock; then its replies and resumes.
pub fn on_phase(filter: Filter, module: ModulePtr, phase: Phase) -> Status {
    // SAFETY: Envoy calls a stream's hooks while the stream lives.
    let stream = unsafe { stream(module) };
    if stream.failed {
        return CONTINUE;
    }
    // the stream's own fields, borrowed apart (no shared count touched per callback)
    let (plugin, slot, link) = (&stream.plugin, &stream.slot, &stream.link);
    let Some(http) = stream.filter.as_mut() else { return CONTINUE };
    let outcome = slot.locked(|_| {
        catch_unwind(AssertUnwindSafe(|| {
            let mut host = NativeHost::stream_direct(filter, &plugin.ids, plugin.direct.as_ref(), link);
            let f = &mut http.0;
            let action = match phase {
                Phase::RequestHeaders(end) => f.on_request_headers(&mut host, end),
                Phase::RequestBody(end) => {
                    let size = host.body_size(true);
                    f.on_request_body(&mut host, size, end)
                }
                Phase::RequestTrailers => f.on_request_trailers(&mut host),
                Phase::ResponseHeaders(end) => f.on_response_headers(&mut host, end),
                Phase::ResponseBody(end) => {
                    let size = host.body_size(false);
                    f.on_response_body(&mut host, size, end)
                }
                Phase::ResponseTrailers => f.on_response_trailers(&mut host),
            };
            (action, host.after)
        }))
    });
    let status = match outcome {
        // Envoy ran this hook from inside one of ours on this thread: let the stream go on
        None => {
            ffi::log(Level::Warn, &format!("tollgate: {phase:?} ran inside another hook; passed through"));
            CONTINUE
        }
        Some(Ok((action, after))) => {
            apply(filter, after);
            status_of(phase, action)
        }
        Some(Err(_)) => fail(stream, filter, phase),
    };
    run_later();
    status
}

/// The filter panicked on this request: it fails closed (a request not yet answered gets 503).
fn fail(stream: &mut Stream, filter: Filter, phase: Phase) -> Status {
    stream.failed = true;
    ffi::log(Level::Error, &format!("tollgate: the filter failed in {phase:?}; answering 503"));
    match phase {
        Phase::RequestHeaders(_) | Phase::RequestBody(_) | Phase::RequestTrailers => {
            let headers = [("content-type".to_string(), "application/json".to_string())];
            ffi::send_response(filter, 503, &headers, UNAVAILABLE, "tollgate_filter_failed");
            STOP
        }
        _ => CONTINUE,
    }
}

/// The answer to a call this stream sent (its decision, mostly).
pub fn stream_call_done(filter: Filter, module: ModulePtr, id: u64, status: Option<u16>, body: Vec<u8>) {
    if inside() {
        later(move || stream_call_done(filter, module, id, status, body));
        return;
    }
    // SAFETY: Envoy calls a stream's hooks while the stream lives.
    let stream = unsafe { stream(module) };
    if stream.failed {
        return;
    }
    let (plugin, slot, link) = (&stream.plugin, &stream.slot, &stream.link);
    let Some(http) = stream.filter.as_mut() else { return };
    let outcome = slot.locked(|_| {
        catch_unwind(AssertUnwindSafe(|| {
            let mut host = NativeHost::stream_direct(filter, &plugin.ids, plugin.direct.as_ref(), link);
            let f = &mut http.0;
            if f.on_call_response(&mut host, id as u32, status, &body) == Action::Continue {
                host.after.push(After::ContinueDecoding);
            }
            if f.take_resume_response() {
                host.after.push(After::ContinueEncoding);
            }
            host.after
        }))
    });
    match outcome {
        Some(Ok(after)) => apply(filter, after),
        Some(Err(_)) => {
            fail(stream, filter, Phase::RequestHeaders(false));
        }
        None => {}
    }
    run_later();
}

/// Answers the module's own connection brought this stream are in (its scheduler woke it on its
/// worker thread): each is taken as a callout's answer.
pub fn stream_scheduled(filter: Filter, module: ModulePtr) {
    // SAFETY: Envoy calls a stream's hooks while the stream lives.
    let stream = unsafe { stream(module) };
    let answers = stream.link.borrow().as_ref().map(|l| l.take(filter, &stream.plugin.ids)).unwrap_or_default();
    for (id, (status, body), _) in answers {
        stream_call_done(filter, module, u64::from(id), status, body);
    }
}

/// The stream ended (before access logs): the filter's `on_log`.
pub fn stream_complete(filter: Filter, module: ModulePtr) {
    // SAFETY: Envoy calls a stream's hooks while the stream lives.
    let stream = unsafe { stream(module) };
    if stream.failed {
        return;
    }
    let (plugin, slot) = (&stream.plugin, &stream.slot);
    let Some(http) = stream.filter.as_mut() else { return };
    let done = slot.locked(|_| {
        let mut host = NativeHost::stream(filter, &plugin.ids);
        http.0.on_log(&mut host);
    });
    if done.is_none() {
        ffi::log(Level::Warn, "tollgate: a stream completed inside another hook; its end was not recorded");
    }
    run_later();
}

pub fn filter_destroy(module: ModulePtr) {
    if module.is_null() {
        return;
    }
    // SAFETY: Envoy destroys a stream's filter once: this takes back the box.
    let stream = unsafe { Box::from_raw(module as *mut Stream) };
    drop_stream(*stream);
}

/// Drops a stream's filter under the lock (its `Rc`s are the worker's too).
fn drop_stream(stream: Stream) {
    if inside() {
        later(move || drop_stream(stream));
        return;
    }
    let Stream { slot, filter, .. } = stream;
    slot.locked(move |_| drop(filter));
}
