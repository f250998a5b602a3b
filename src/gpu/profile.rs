//! Where a step's device time goes (`bench --device cuda --profile`): while a profile is open
//! the device stamps its stream before each operation it queues (a timing event on a GPU, the
//! host's clock on the emulated device, which runs each operation as it is queued), and the
//! time from one stamp to the next is charged to the operation queued at the first. Time the
//! GPU spent waiting for the host to queue work falls to the operation before the wait.

use anyhow::Result;
use cudarc::driver::{CudaEvent, CudaStream};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

enum Stamp {
    Event(CudaEvent),
    Host(Instant),
}

/// One operation of a profile: a kernel by name, a matrix product by shape, a copy.
#[derive(Clone, Debug, Serialize)]
pub struct Op {
    pub what: String,
    pub seconds: f64,
    /// Times it was queued.
    pub calls: usize,
    /// Floating-point operations it did in all (products only; 0 for the rest).
    pub flops: f64,
}

impl Op {
    /// Whether it is one of cuBLASLt's products.
    pub fn is_product(&self) -> bool {
        self.flops > 0.0
    }
}

/// The stamps of the open profile, if one is open: what each starts, and its flops.
#[derive(Default)]
pub struct Profiler {
    stamps: Mutex<Option<Vec<(String, f64, Stamp)>>>,
}

impl Profiler {
    /// Starts a profile, dropping any open one.
    pub fn open(&self) {
        *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// Stamps the start of operation `what` (of `flops` floating-point operations, for a
    /// product) where a profile is open: on `stream`, or with the host's clock. `what` is
    /// made only then.
    pub fn stamp(
        &self,
        what: impl FnOnce() -> String,
        flops: f64,
        stream: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        let mut stamps = self.stamps.lock().unwrap_or_else(|e| e.into_inner());
        let Some(stamps) = stamps.as_mut() else { return Ok(()) };
        let stamp = match stream {
            Some(s) => {
                let timed = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
                Stamp::Event(s.record_event(Some(timed))?)
            }
            None => Stamp::Host(Instant::now()),
        };
        stamps.push((what(), flops, stamp));
        Ok(())
    }

    /// Closes the profile with a last stamp (queued after the work before it, on `stream`):
    /// the operations, the costliest first. Empty where none was open.
    pub fn close(&self, stream: Option<&Arc<CudaStream>>) -> Result<Vec<Op>> {
        self.stamp(|| "end".to_string(), 0.0, stream)?;
        let Some(stamps) = self.stamps.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(Vec::new());
        };
        let mut ops: HashMap<String, Op> = HashMap::new();
        for pair in stamps.windows(2) {
            let ((what, flops, from), (_, _, to)) = (&pair[0], &pair[1]);
            let secs = match (from, to) {
                // Waits for both events.
                (Stamp::Event(a), Stamp::Event(b)) => a.elapsed_ms(b)? as f64 / 1e3,
                (Stamp::Host(a), Stamp::Host(b)) => (*b - *a).as_secs_f64(),
                _ => unreachable!("one device stamps one way"),
            };
            let op = ops.entry(what.clone()).or_insert_with(|| Op {
                what: what.clone(),
                seconds: 0.0,
                calls: 0,
                flops: 0.0,
            });
            op.seconds += secs;
            op.calls += 1;
            op.flops += flops;
        }
        let mut ops: Vec<Op> = ops.into_values().collect();
        ops.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.what.cmp(&b.what)));
        Ok(ops)
    }
}
