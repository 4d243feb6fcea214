//! The ABI's schedulers: a configuration's (its tick, on Envoy's main thread) and a stream's
//! (answers from the module's own connection, on the stream's worker thread). Apart from
//! [`crate::ffi`] for size; the same rules: the project's own declarations from Envoy's
//! `abi.h`, every use explained.

use crate::ffi::{Config, EnvoyPtr, Filter};

extern "C" {
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: EnvoyPtr) -> EnvoyPtr;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: EnvoyPtr, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: EnvoyPtr);
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: EnvoyPtr) -> EnvoyPtr;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: EnvoyPtr, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: EnvoyPtr);
}

/// A configuration's scheduler: wakes its `on_http_filter_config_scheduled` hook on Envoy's main
/// thread, from any thread.
pub struct Scheduler(EnvoyPtr);

// SAFETY: Envoy documents commit as safe from any thread; delete is called once, by the owner.
unsafe impl Send for Scheduler {}
unsafe impl Sync for Scheduler {}

impl Scheduler {
    pub fn new(config: Config) -> Option<Scheduler> {
        // SAFETY: `config` is the configuration being created.
        let p = unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(config.raw()) };
        (!p.is_null()).then_some(Scheduler(p))
    }
    pub fn commit(&self, event: u64) {
        // SAFETY: the scheduler lives until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by scheduler_new, deleted once.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0) }
    }
}

/// A stream's scheduler: wakes its `on_http_filter_scheduled` hook on the stream's worker
/// thread, from any thread. Envoy's scheduler holds the stream weakly: a commit after the stream
/// ended runs nothing. Deleting it while another thread commits is not allowed: its owners share
/// it through an `Arc`, and the last one deletes it (on whichever thread drops it).
pub struct StreamScheduler(EnvoyPtr);

// SAFETY: as for [`Scheduler`]: commit from any thread; delete once, by the last owner.
unsafe impl Send for StreamScheduler {}
unsafe impl Sync for StreamScheduler {}

impl StreamScheduler {
    /// For the stream of the current hook (its decoder callbacks are set).
    pub fn new(filter: Filter) -> Option<StreamScheduler> {
        // SAFETY: `filter` is the stream of the current hook.
        let p = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(filter.raw()) };
        (!p.is_null()).then_some(StreamScheduler(p))
    }
    pub fn commit(&self, event: u64) {
        // SAFETY: the scheduler lives until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }
}

impl Drop for StreamScheduler {
    fn drop(&mut self) {
        // SAFETY: created by scheduler_new, deleted once (the last owner drops it).
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

