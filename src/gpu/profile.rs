//! Where a step's device time goes (`bench --device cuda --profile`): while a profile is open
//! the device stamps its stream before each operation it queues (a timing event on a GPU, the
//! host's clock on the emulated device, which runs each operation as it is queued), and the
//! time from one stamp to the next is charged to the operation queued at the first. Time the
//! GPU spent waiting for the host to queue work falls to the operation before the wait.

use anyhow::Result;
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

enum Stamp {
    Event(CudaEvent),
    Host(Instant),
}

/// The stamps of the open profile, if one is open.
#[derive(Default)]
pub struct Profiler {
    stamps: Mutex<Option<Vec<(String, Stamp)>>>,
}

impl Profiler {
    /// Starts a profile, dropping any open one.
    pub fn open(&self) {
        *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// Stamps the start of operation `what` where a profile is open: on `stream`, or with the
    /// host's clock.
    pub fn stamp(&self, what: &str, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        let mut stamps = self.stamps.lock().unwrap_or_else(|e| e.into_inner());
        let Some(stamps) = stamps.as_mut() else { return Ok(()) };
        let stamp = match stream {
            Some(s) => {
                let timed = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
                Stamp::Event(s.record_event(Some(timed))?)
            }
            None => Stamp::Host(Instant::now()),
        };
        stamps.push((what.to_string(), stamp));
        Ok(())
    }

    /// Closes the profile with a last stamp (queued after the work before it, on `stream`):
    /// seconds per operation, the most first. Empty where none was open.
    pub fn close(&self, stream: Option<&Arc<CudaStream>>) -> Result<Vec<(String, f64)>> {
        self.stamp("end", stream)?;
        let Some(stamps) = self.stamps.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(Vec::new());
        };
        let mut total: HashMap<String, f64> = HashMap::new();
        for pair in stamps.windows(2) {
            let ((what, from), (_, to)) = (&pair[0], &pair[1]);
            let secs = match (from, to) {
                // Waits for both events.
                (Stamp::Event(a), Stamp::Event(b)) => a.elapsed_ms(b)? as f64 / 1e3,
                (Stamp::Host(a), Stamp::Host(b)) => (*b - *a).as_secs_f64(),
                _ => unreachable!("one device stamps one way"),
            };
            *total.entry(what.clone()).or_default() += secs;
        }
        let mut total: Vec<(String, f64)> = total.into_iter().collect();
        total.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        Ok(total)
    }
}
