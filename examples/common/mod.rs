//! What the GPU examples share: the device's memory as `nvidia-smi` reports it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The whole GPU's used memory, sampled every 20 ms by an `nvidia-smi` child process: what the
/// driver sees, Burn's pools and the CUDA context included.
pub struct DeviceMemory {
    child: Child,
    baseline: u64,
    current: Arc<AtomicU64>,
    peak: Arc<AtomicU64>,
}

impl DeviceMemory {
    /// Starts sampling; `None` when `nvidia-smi` cannot run or prints no figure.
    pub fn start() -> Option<Self> {
        let mut child = Command::new("nvidia-smi")
            .args([
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                "0",
                "-lms",
                "20",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut lines = BufReader::new(child.stdout.take()?).lines();
        let baseline = lines.next()?.ok()?.trim().parse::<u64>().ok()?;
        let current = Arc::new(AtomicU64::new(baseline));
        let peak = Arc::new(AtomicU64::new(baseline));
        let (c, p) = (current.clone(), peak.clone());
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Ok(mib) = line.trim().parse::<u64>() {
                    c.store(mib, Ordering::Relaxed);
                    p.fetch_max(mib, Ordering::Relaxed);
                }
            }
        });
        Some(Self {
            child,
            baseline,
            current,
            peak,
        })
    }

    /// Memory in use when sampling started, in GB.
    pub fn baseline_gb(&self) -> f64 {
        gb(self.baseline)
    }

    /// The peak since the previous call (or the start), in GB; starts a new window.
    pub fn take_peak(&self) -> f64 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = self.current.load(Ordering::Relaxed);
        gb(self.peak.swap(now, Ordering::Relaxed))
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // The sampler is this program's own child.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// MiB as `nvidia-smi` prints them, in GB.
fn gb(mib: u64) -> f64 {
    mib as f64 * 1.048576e6 / 1e9
}
