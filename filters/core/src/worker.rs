//! One worker's filter, as its root context holds it: the configuration, what the worker's
//! requests share (queues, its copy of the routing table and of the auth cache, its decision
//! ids), and the background jobs its tick drives.
//!
//! ```text
//!  HTTP contexts ── push ──► completions · refunds · usage events · responses to store · renewals
//!                             · breaker successes · idempotency claims (open, close)
//!  root tick ──► the generation (every tick; the elected context polls the change count) ─
//!               breakers: successes, views (every tick) ─ renewals (every tick) ─ completions and refunds (completionFlushInterval) ─ responses (every
//!               tick) ─ claims kept (every tick, those due) ─ usage (usage.flushInterval) ─ routing table ─ breaker hints (pollInterval)
//!  call responses ──► the job that owns the token
//! ```
//!
//! The adapter makes one `Worker` in `on_configure`, defines the counters it lists, sets the
//! tick it asks for, and forwards `on_tick`, `on_http_call_response` and
//! `create_http_context` to it.

use crate::auth_cache::LocalAllows;
use crate::batch::{DecisionBatcher, Delivery};
use crate::breaker::{self, guard::BreakerGuard, hints::HintPoller, local::WorkerBreakers};
use crate::changes::{ChangesJob, Generation};
use crate::completions::CompletionQueue;
use crate::refunds::{RefundQueue, MAX_QUEUED_REFUNDS, MAX_REFUND_BATCH};
use crate::config::FilterConfig;
use crate::filter::kept::KeptBudget;
use crate::filter::AuthFilter;
use crate::flush::{BatchFlusher, Drain, FlushSpec};
use crate::host::{Host, LogLevel};
use crate::http::HttpFilter;
use crate::ids::DecisionIds;
use crate::jobs::{Cadence, Every, Job};
use crate::lease::renewer::{LeaseRenewer, RenewalQueue};
use crate::responses::claims::{ClaimBook, ClaimKeeper};
use crate::responses::queue::ResponseQueue;
use crate::routing::{RouteTablePoller, RoutesJob, WorkerRoutes};
use crate::shared_keys;
use crate::stats::{Metric, Stream};
use crate::usage::{self, Meter};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use tollgate_wire::responses::RESPONSES_PATH;
use tollgate_wire::usage::USAGE_PATH;
use tollgate_wire::refunds::REFUNDS_PATH;
use tollgate_wire::COMPLETIONS_PATH;

/// Completion reports a worker keeps while the sidecar is unreachable.
pub const MAX_QUEUED_COMPLETIONS: usize = 10_000;
/// Completion reports per `POST /v1/completions`.
pub const MAX_COMPLETION_BATCH: usize = 500;
/// Responses to store a worker keeps at most (items, bytes), and bytes per `POST /v1/responses`.
pub const MAX_QUEUED_RESPONSES: usize = 1_000;
pub const MAX_QUEUED_RESPONSE_BYTES: usize = 32 << 20;
pub const MAX_RESPONSE_BATCH_BYTES: usize = 4 << 20;

// Batch sizes agree end to end: every batch's serialized size (items bound exactly, plus the
// few bytes around them) stays below the sidecar's limit for its endpoint.
const _: () = assert!(MAX_RESPONSE_BATCH_BYTES + crate::responses::queue::BATCH_OVERHEAD < tollgate_wire::responses::RESPONSES_BODY_LIMIT);
const _: () = assert!(crate::completions::DEFAULT_MAX_BATCH_BYTES + 64 < tollgate_wire::BODY_LIMIT);
/// The longest a queued lease renewal waits for its root context's tick.
pub const LEASE_TICK: Duration = Duration::from_millis(20);
/// The slowest tick of a worker whose decision stream is on: its tick fails the decisions not
/// answered in time, so the failure mode applies at most this long after `sidecar.timeout`
/// (crate::stream).
pub const STREAM_TICK: Duration = Duration::from_millis(50);
/// How long a worker whose plugin configuration Envoy dropped keeps sending what its queues
/// hold before it drops the rest, counted ([`Worker::end`]; decision 156): a sidecar restart
/// fits, a usage batch's 5 s deadline several times.
pub const END_GRACE: Duration = Duration::from_secs(30);
/// How often an ending worker sends again what the sidecar did not take (the first send is at
/// its first tick; a batch taken with a whole one waiting sends the next at once).
pub const END_RETRY: Duration = Duration::from_secs(1);

/// Randomness the adapter draws from the host, once per VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seeds {
    /// The secret seed of decision ids (crate::ids).
    pub decision_ids: [u8; 32],
    /// The seed of usage event ids.
    pub usage_ids: u64,
    /// This VM's identity in the hint poller's election.
    pub hints_owner: u64,
    /// This VM's identity in the route poller's election.
    pub routes_owner: u64,
    /// This VM's identity in the change poller's election.
    pub changes_owner: u64,
}

/// One worker's filter (see the module docs).
pub struct Worker {
    config: Rc<FilterConfig>,
    completions: Rc<RefCell<CompletionQueue>>,
    refunds: Rc<RefCell<RefundQueue>>,
    meter: Rc<RefCell<Meter>>,
    responses: Rc<RefCell<ResponseQueue>>,
    /// The idempotency claims its running requests hold (crate::responses::claims).
    claims: Rc<RefCell<ClaimBook>>,
    renewals: Rc<RefCell<RenewalQueue>>,
    routes: Rc<RefCell<WorkerRoutes>>,
    local_allows: Rc<RefCell<LocalAllows>>,
    decision_ids: Rc<RefCell<DecisionIds>>,
    gen: Generation,
    // the background jobs, in the order a tick runs them
    changes: Option<ChangesJob>,
    renewer: LeaseRenewer,
    completion_flusher: Every<BatchFlusher<CompletionQueue>>,
    refund_flusher: Every<BatchFlusher<RefundQueue>>,
    response_flusher: BatchFlusher<ResponseQueue>,
    claim_keeper: ClaimKeeper,
    usage_flusher: Option<Every<BatchFlusher<Meter>>>,
    route_poller: Option<RoutesJob>,
    hint_poller: Option<Every<HintPoller>>,
    /// Its view of the breakers and its tallied successes (breaker::local).
    breakers: Rc<RefCell<WorkerBreakers>>,
    /// Its decision calls: alone, waiting, the batch out (crate::batch).
    decisions: Rc<RefCell<DecisionBatcher>>,
    /// The bytes of response bodies its requests keep (crate::filter::kept).
    kept: KeptBudget,
    /// Envoy dropped this configuration ([`Worker::end`]): when its grace ends (host ms), and
    /// when its queues are sent ([`END_RETRY`]).
    ending: Option<(u64, Cadence)>,
}

impl Worker {
    /// The worker of a configuration; writes the initial state of every breaker target to shared
    /// data (before any traffic, so later updates always have a CAS token).
    pub fn new(host: &mut impl Host, config: Rc<FilterConfig>, seeds: Seeds) -> Worker {
        for t in &config.breakers.targets {
            breaker::init(host, &shared_keys::breaker(&t.name));
        }
        let sidecar = &config.sidecar;
        let completions = Rc::new(RefCell::new(CompletionQueue::new(MAX_QUEUED_COMPLETIONS)));
        let refunds = Rc::new(RefCell::new(RefundQueue::new(MAX_QUEUED_REFUNDS)));
        let meter = Rc::new(RefCell::new(Meter::bounded(config.usage.max_queued, config.usage.max_queued_bytes, seeds.usage_ids)));
        let responses = Rc::new(RefCell::new(ResponseQueue::new(MAX_QUEUED_RESPONSES, MAX_QUEUED_RESPONSE_BYTES)));
        let claims: Rc<RefCell<ClaimBook>> = Rc::default();
        let renewals = Rc::new(RefCell::new(RenewalQueue::default()));
        let routes = Rc::new(RefCell::new(WorkerRoutes::default()));
        let local_allows: Rc<RefCell<LocalAllows>> = Rc::default();
        let gen = Generation::default();
        let changes = config.changes.enabled.then(|| {
            // how long after it is sent a call's answer may still be trusted: its timeout, then
            // an auth answer's life or a lease's (the sidecar's bound is 500 ms; LEASE_TRUST)
            let answered_within = sidecar.timeout.max(crate::lease::RENEWAL_TIMEOUT);
            let cached_for = answered_within + config.auth_cache_max_ttl.max(crate::changes::LEASE_TRUST);
            let job = ChangesJob::new(config.changes.clone(), sidecar.clone(), seeds.changes_owner, gen.clone(), local_allows.clone(), cached_for);
            job.refresh(host);
            job
        });
        // A batch may wait longer than a decision: it is off the request path.
        let off_path = sidecar.timeout.max(Duration::from_secs(2));
        let completion_spec = FlushSpec::new(Stream::Completions, "completions", COMPLETIONS_PATH, MAX_COMPLETION_BATCH, off_path);
        // a batch it cannot read, or a sidecar without refunds: retrying cannot help
        let refund_spec = FlushSpec::new(Stream::Refunds, "abandoned decisions to refund", REFUNDS_PATH, MAX_REFUND_BATCH, off_path)
            .refused_by(&[400, 404]);
        let response_spec =
            FlushSpec::new(Stream::Responses, "responses to store", RESPONSES_PATH, MAX_RESPONSE_BATCH_BYTES, Duration::from_secs(5));
        // The sidecar answers a usage batch once it is on disk (an fsync): allow it a few seconds.
        // Not metering there, or a batch it can never read: retrying cannot help.
        let usage_spec =
            FlushSpec::new(Stream::Usage, "usage events", USAGE_PATH, usage::MAX_BATCH, Duration::from_secs(5)).refused_by(&[400, 404]);
        // its first turn a whole interval after the start (nothing waits before): a worker's
        // first batch is as full as its later ones
        let now = host.now_ms();
        let usage_flusher = config.usage.enabled.then(|| {
            Every::new(config.usage.flush_interval, BatchFlusher::new(meter.clone(), usage_spec, sidecar.clone())).first_after(now)
        });
        let route_poller = config.routing.enabled.then(|| RoutesJob {
            poller: RouteTablePoller::new(config.routing.clone(), sidecar.clone(), seeds.routes_owner),
            routes: routes.clone(),
        });
        let breakers: Rc<RefCell<WorkerBreakers>> = Rc::default();
        let hint_poller = config.breakers.shares_hints().then(|| {
            let poller = HintPoller::new(config.breakers.clone(), sidecar.clone(), seeds.hints_owner).with_worker(breakers.clone());
            Every::new(config.breakers.hints.poll_interval, poller)
        });
        Worker {
            changes,
            renewer: LeaseRenewer::new(renewals.clone(), sidecar.clone()).with_generation(gen.clone()),
            completion_flusher: Every::new(
                config.completion_flush_interval,
                BatchFlusher::new(completions.clone(), completion_spec, sidecar.clone()),
            ),
            refund_flusher: Every::new(config.completion_flush_interval, BatchFlusher::new(refunds.clone(), refund_spec, sidecar.clone())),
            response_flusher: BatchFlusher::new(responses.clone(), response_spec, sidecar.clone()),
            claim_keeper: ClaimKeeper::new(claims.clone(), sidecar.clone()),
            usage_flusher,
            route_poller,
            hint_poller,
            breakers,
            decisions: Rc::default(),
            kept: KeptBudget::new(config.max_kept_body_bytes),
            ending: None,
            completions,
            refunds,
            meter,
            responses,
            claims,
            renewals,
            routes,
            local_allows,
            gen,
            decision_ids: Rc::new(RefCell::new(DecisionIds::new(seeds.decision_ids))),
            config,
        }
    }

    pub fn config(&self) -> &FilterConfig {
        &self.config
    }

    /// The counters to define (each flusher's only when its stream is on).
    pub fn metrics(&self) -> Vec<Metric> {
        let c = &self.config;
        let mut v = Metric::requests();
        v.extend(Metric::flush(Stream::Completions));
        v.extend(Metric::flush(Stream::Refunds));
        if c.response_cache.enabled || c.idempotency.enabled {
            v.extend(Metric::flush(Stream::Responses));
        }
        if c.usage.enabled {
            v.extend(Metric::flush(Stream::Usage));
        }
        v
    }

    /// The counters named at configuration time (per breaker target).
    pub fn named_metrics(&self) -> Vec<String> {
        self.config.breakers.metric_names()
    }

    /// The root context's fastest tick: the fastest cadence of the jobs that are on (20 ms with
    /// leases on). The adapter starts with it, then follows [`Self::tick_period_now`].
    pub fn tick_period(&self) -> Duration {
        if self.config.leases.enabled {
            // lease renewals wait for the tick: keep it well under `renewAhead`
            return self.slow_tick_period().min(LEASE_TICK);
        }
        self.slow_tick_period()
    }

    /// The tick this worker needs now (the adapter sets it when it changes, after each tick):
    /// the lease tick only while its renewals are in use ([`LeaseRenewer::busy`]), else the
    /// fastest of the other jobs' cadences. A renewal queued meanwhile waits at most one slow
    /// tick (50 ms with the change poll), then the tick is fast again (decision 272).
    pub fn tick_period_now(&self, now_ms: u64) -> Duration {
        if self.config.leases.enabled && (self.renewer.busy(now_ms) || self.ending.is_some()) {
            return self.tick_period();
        }
        self.slow_tick_period()
    }

    /// The fastest cadence of the jobs but lease renewals.
    fn slow_tick_period(&self) -> Duration {
        let c = &self.config;
        let mut tick = c.completion_flush_interval;
        if self.hint_poller.is_some() {
            tick = tick.min(c.breakers.hints.poll_interval);
        }
        if c.usage.enabled {
            tick = tick.min(c.usage.flush_interval);
        }
        if c.routing.enabled {
            tick = tick.min(c.routing.refresh_interval);
        }
        if c.changes.enabled {
            // a change reaches a worker within one poll and one tick
            tick = tick.min(c.changes.poll_interval);
        }
        if self.decisions.borrow().stream.enabled() {
            tick = tick.min(STREAM_TICK);
        }
        tick
    }

    /// A new HTTP request's filter, sharing this worker's parts; its decision calls go alone.
    pub fn request(&self) -> HttpFilter {
        self.http(self.auth())
    }

    /// The filter of the HTTP request in context `ctx`: as [`Self::request`], but its decision
    /// may ride the worker's batches once [`Self::enable_batching`] turned them on.
    pub fn request_in(&self, ctx: u32) -> HttpFilter {
        self.http(self.auth().with_batcher(self.decisions.clone(), ctx))
    }

    fn auth(&self) -> AuthFilter {
        AuthFilter::new(self.config.clone(), self.completions.clone())
            .with_meter(self.meter.clone())
            .with_routes(self.routes.clone())
            .with_responses(self.responses.clone(), self.claims.clone())
            .with_leases(self.renewals.clone())
            .with_local_allows(self.local_allows.clone())
            .with_generation(self.gen.clone())
            .with_decision_ids(self.decision_ids.clone())
            .with_refunds(self.refunds.clone())
            .with_kept_budget(self.kept.clone())
    }

    fn http(&self, filter: AuthFilter) -> HttpFilter {
        HttpFilter::new(filter, BreakerGuard::new(self.config.breakers.clone()).with_worker(self.breakers.clone()))
    }

    /// The adapter can wake the root context (crate::batch): decisions are batched under
    /// concurrency from now on, unless the configuration says `batchDecisions: false`.
    pub fn enable_batching(&mut self) {
        if self.config.sidecar.batch_decisions {
            self.decisions.borrow_mut().enable();
        }
    }

    /// The adapter's host holds gRPC streams (crate::stream): decisions go on the worker's
    /// stream from its next tick on, unless the configuration says `decisionStream: false`.
    /// Needs [`Self::request_in`] (the stream's answers find their request by its context).
    pub fn enable_stream(&mut self) {
        if self.config.sidecar.decision_stream {
            self.decisions.borrow_mut().stream.enable();
        }
    }

    /// The sidecar's answer head on stream `token`: whether (and in which format) the stream
    /// carries decisions from now on.
    pub fn on_stream_head(&mut self, host: &mut impl Host, token: u32, head: crate::stream::Head) {
        self.decisions.borrow_mut().stream.on_head(host, token, head);
    }

    /// A message of the stream `token`: a decision's answer, for the adapter to deliver.
    pub fn on_stream_message(&mut self, host: &mut impl Host, token: u32, message: &[u8]) -> Vec<Delivery> {
        let mut decisions = self.decisions.borrow_mut();
        if !decisions.stream.owns(token) {
            return Vec::new();
        }
        decisions.stream.on_message(host, message).into_iter().collect()
    }

    /// The stream `token` ended with gRPC `status`: its decisions out fail, for the adapter to
    /// deliver.
    pub fn on_stream_close(&mut self, host: &mut impl Host, token: u32, status: u32) -> Vec<Delivery> {
        self.decisions.borrow_mut().stream.on_close(host, token, status)
    }

    /// The root context was woken: sends the decisions waiting, if no batch is out. Returns the
    /// answers for the adapter to deliver (items that failed without a call).
    pub fn send_decisions(&mut self, host: &mut impl Host) -> Vec<Delivery> {
        self.decisions.borrow_mut().send(host, &self.config.sidecar)
    }

    /// Envoy dropped this worker's plugin configuration (a new one replaces it, or Envoy stops):
    /// no request of it is left. Returns whether the root context may go now — nothing queued
    /// (usage events, completion reports, refunds, responses to store) and nothing in flight.
    /// Otherwise its ticks send what is left, whatever each stream's cadence, until nothing is
    /// ([`Worker::has_ended`]) or [`END_GRACE`] has passed, when the rest is dropped and counted
    /// (decision 156). Nothing is sent from here: Envoy may be stopping, its dispatcher gone.
    pub fn end(&mut self, host: &mut impl Host) -> bool {
        if self.ending.is_none() {
            self.ending = Some((host.now_ms().saturating_add(END_GRACE.as_millis() as u64), Cadence::every(END_RETRY)));
            let left = self.left();
            if left > 0 {
                let what = "usage events, completions, refunds, responses to store";
                host.log(
                    LogLevel::Info,
                    &format!("tollgate: this plugin configuration ended with {left} queued items ({what}); its worker sends them before it goes, unless Envoy is stopping"),
                );
            }
        }
        self.has_ended()
    }

    /// It was ended ([`Worker::end`]) and holds nothing more: its root context may go.
    pub fn has_ended(&self) -> bool {
        self.ending.is_some() && self.left() == 0
    }

    /// Items its queues hold, waiting or in flight.
    fn left(&self) -> usize {
        self.completion_flusher.left() + self.refund_flusher.left() + self.response_flusher.left() + self.usage_flusher.left()
    }

    /// A tick of an ending worker: its queues only, at once and then every [`END_RETRY`] (a
    /// sidecar that refuses is not pressed at every tick).
    fn drain(&mut self, host: &mut impl Host, until_ms: u64, due: bool) {
        if host.now_ms() < until_ms {
            if !due {
                return;
            }
            self.completion_flusher.drain(host);
            self.refund_flusher.drain(host);
            self.response_flusher.drain(host);
            self.usage_flusher.drain(host);
            return;
        }
        let lost = self.completion_flusher.abandon(host)
            + self.refund_flusher.abandon(host)
            + self.response_flusher.abandon(host)
            + self.usage_flusher.abandon(host);
        if lost > 0 {
            host.log(
                LogLevel::Warn,
                &format!("tollgate: an ended plugin configuration's worker could not send {lost} queued items in {END_GRACE:?}; dropped and counted"),
            );
        }
    }

    /// One tick: every job, in order.
    /// Returns decision answers for the adapter to deliver: the tick also sends a batch a lost
    /// wake left waiting (crate::batch).
    pub fn on_tick(&mut self, host: &mut impl Host) -> Vec<Delivery> {
        if let Some((until_ms, retry)) = self.ending.as_mut() {
            let (until_ms, due) = (*until_ms, retry.due(host.now_ms()));
            self.drain(host, until_ms, due);
            return Vec::new();
        }
        let mut deliveries = self.send_decisions(host);
        {
            let mut decisions = self.decisions.borrow_mut();
            deliveries.extend(decisions.stream.expire(host.now_ms()));
            decisions.stream.keep_open(host, &self.config.sidecar);
        }
        self.changes.on_tick(host);
        self.breakers.borrow_mut().on_tick(host, &self.config.breakers);
        self.renewer.on_tick(host);
        self.completion_flusher.on_tick(host);
        self.refund_flusher.on_tick(host);
        self.response_flusher.on_tick(host);
        self.claim_keeper.on_tick(host);
        self.usage_flusher.on_tick(host);
        self.route_poller.on_tick(host);
        self.hint_poller.on_tick(host);
        deliveries
    }

    /// A call response at the root context, for the job that owns `token`. `body` reads the
    /// response body (a host call), only for a job that wants it; `status` is read only when
    /// needed (a decision batch's answer that decodes needs none: crate::sidecar::interpret).
    ///
    /// A decision batch's answer returns each item's answer for the adapter to deliver to its
    /// request's context, and sends the decisions that waited meanwhile (crate::batch).
    pub fn on_call_response(
        &mut self,
        host: &mut impl Host,
        token: u32,
        status: impl crate::sidecar::CallStatus,
        body: impl FnOnce() -> Vec<u8>,
    ) -> Vec<Delivery> {
        if self.decisions.borrow().owns(token) {
            let mut deliveries = self.decisions.borrow_mut().on_answer(token, status, &body());
            deliveries.extend(self.send_decisions(host));
            return deliveries;
        }
        let status = status.read();
        let mut body = Some(body);
        let mut read = || body.take().map_or_else(Vec::new, |f| f());
        let delivered = deliver(&mut self.usage_flusher, host, token, status, &mut read)
            || deliver(&mut self.response_flusher, host, token, status, &mut read)
            || deliver(&mut self.claim_keeper, host, token, status, &mut read)
            || deliver(&mut self.completion_flusher, host, token, status, &mut read)
            || deliver(&mut self.refund_flusher, host, token, status, &mut read)
            || deliver(&mut self.route_poller, host, token, status, &mut read)
            || deliver(&mut self.changes, host, token, status, &mut read)
            || deliver(&mut self.renewer, host, token, status, &mut read)
            || deliver(&mut self.hint_poller, host, token, status, &mut read);
        if !delivered {
            host.log(LogLevel::Debug, "tollgate: ignoring a call response with an unexpected token");
        }
        Vec::new()
    }

    /// This worker's queues, for tests and tools: completions, usage, responses, renewals.
    pub fn completions(&self) -> &Rc<RefCell<CompletionQueue>> {
        &self.completions
    }
    pub fn refunds(&self) -> &Rc<RefCell<RefundQueue>> {
        &self.refunds
    }
    pub fn meter(&self) -> &Rc<RefCell<Meter>> {
        &self.meter
    }
    pub fn responses(&self) -> &Rc<RefCell<ResponseQueue>> {
        &self.responses
    }
    pub fn claims(&self) -> &Rc<RefCell<ClaimBook>> {
        &self.claims
    }
    pub fn renewals(&self) -> &Rc<RefCell<RenewalQueue>> {
        &self.renewals
    }
    pub fn routes(&self) -> &Rc<RefCell<WorkerRoutes>> {
        &self.routes
    }
}

/// Gives `job` the response to `token` if it owns it.
fn deliver<J: Job>(job: &mut J, host: &mut impl Host, token: u32, status: Option<u16>, body: &mut impl FnMut() -> Vec<u8>) -> bool {
    if !job.owns(token) {
        return false;
    }
    let body = if job.reads_body() { body() } else { Vec::new() };
    job.on_call_response(host, token, status, &body);
    true
}
