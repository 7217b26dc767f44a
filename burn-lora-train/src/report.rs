//! What a run shows and leaves behind: logs on the terminal and in `train.log`, a progress bar,
//! the loss CSV and its plot, and the Ctrl-C flag the loop polls.
//!
//! - [`init_logging`] installs the `tracing` subscriber once per process: the terminal gets
//!   what the `BURNLORA_LOG` filter lets through (default `info`); [`Logging::add_file`] later
//!   sends the same lines to a file (the run's `train.log`). Lines printed while a [`Progress`]
//!   bar is shown are written above it.
//! - [`LossLog`] appends `step,loss,lr,seconds` rows to `loss.csv` (one `write` per row; a torn
//!   last row is dropped when the file is read back), and [`plot_loss`] draws `loss.png`.
//! - CubeCL's reports of the kernels it tunes (forwarded to `tracing` under `cubecl*` targets,
//!   see `kernels.rs`) are followed rather than printed; a [`Heartbeat`] says every
//!   [`HEARTBEAT`] what a long phase is doing: how many shapes were tuned, and which was last.
//! - [`StopFlag::install`] turns the first Ctrl-C into a request to stop (the loop saves a
//!   checkpoint and exits); a second Ctrl-C ends the process at once.
//!
//! Plot text uses DejaVu Sans Mono, compiled in from `assets/` (Bitstream Vera license, see
//! `assets/DejaVu-LICENSE.txt`), so no system font is needed.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::Context;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

use crate::checkpoint::{CheckpointError, write_atomically};

/// The environment variable holding the log filter (`info`, `burn_lora_train=debug`, …).
pub const LOG_ENV: &str = "BURNLORA_LOG";

/// Name of the loss CSV in the run folder.
pub const LOSS_CSV: &str = "loss.csv";

/// Name of the loss plot in the run folder.
pub const LOSS_PNG: &str = "loss.png";

/// Name of the log file in the run folder.
pub const LOG_FILE: &str = "train.log";

/// Header of the loss CSV.
const CSV_HEADER: &str = "step,loss,lr,seconds";

/// The plot font (DejaVu Sans Mono, Bitstream Vera license).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

/// A problem writing the run's reports.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The plot could not be drawn.
    #[error("drawing {path}: {message}")]
    Plot {
        /// The image file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// The logging or Ctrl-C handler could not be installed (it already was).
    #[error("{0}")]
    Setup(String),
}

impl From<CheckpointError> for ReportError {
    fn from(e: CheckpointError) -> Self {
        match e {
            CheckpointError::Io { path, source } => Self::Io { path, source },
            other => Self::Setup(other.to_string()),
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The bar currently shown, so that log lines can be written above it.
static ACTIVE_BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Writes log lines to stderr, above the progress bar when one is shown.
#[derive(Clone, Copy)]
struct Terminal;

impl Write for Terminal {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let bar = ACTIVE_BAR.lock().map(|b| b.clone()).unwrap_or(None);
        match bar {
            Some(bar) => bar.suspend(|| std::io::stderr().write_all(buf))?,
            None => std::io::stderr().write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

type FileLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// The installed subscriber: the terminal now, a log file once [`Logging::add_file`] is called.
pub struct Logging {
    file: reload::Handle<Option<FileLayer>, Registry>,
    guard: Mutex<Option<tracing_appender::non_blocking::WorkerGuard>>,
}

impl std::fmt::Debug for Logging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Logging").finish_non_exhaustive()
    }
}

/// Whether an event comes from CubeCL (its kernel reports, forwarded from the `log` crate).
fn from_cubecl(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.target().starts_with("cubecl")
}

/// Kernel shapes CubeCL has finished tuning in this process.
static TUNED: AtomicU64 = AtomicU64::new(0);
/// What CubeCL started tuning last (its report's first line, shortened).
static TUNING: Mutex<String> = Mutex::new(String::new());

/// Follows CubeCL's autotune reports: "Tuning <key>" when it starts on a new shape, "Fastest
/// result <kernel>-<key>" when it has chosen.
struct KernelReports;

impl<S: tracing::Subscriber> Layer<S> for KernelReports {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        let line = message.0.lines().next().unwrap_or_default();
        if line.starts_with("Fastest result") {
            TUNED.fetch_add(1, Ordering::Relaxed);
        } else if let Some(key) = line.strip_prefix("Tuning ")
            && let Ok(mut tuning) = TUNING.lock()
        {
            *tuning = key.chars().take(100).collect();
        }
    }
}

/// How often a [`Heartbeat`] reports.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// Reports, every [`HEARTBEAT`] until dropped, that `phase` is still running and how many
/// kernels CubeCL has tuned so far (the first run on a machine compiles and tunes the kernels of
/// every new shape; later runs read them from the kernel caches).
#[must_use = "the heartbeat stops when dropped"]
pub struct Heartbeat {
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts reporting on `phase` (a phrase such as "encoding 6 images with the VAE").
    pub fn start(phase: String) -> Self {
        let stop = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let signal = stop.clone();
        let started = Instant::now();
        let tuned_before = TUNED.load(Ordering::Relaxed);
        let thread = std::thread::spawn(move || {
            let (lock, wake) = &*signal;
            let mut stopped = lock.lock().expect("heartbeat lock");
            loop {
                let (guard, timeout) = wake
                    .wait_timeout(stopped, HEARTBEAT)
                    .expect("heartbeat lock");
                stopped = guard;
                if *stopped {
                    return;
                }
                if timeout.timed_out() {
                    let tuned = TUNED.load(Ordering::Relaxed) - tuned_before;
                    let tuning = TUNING.lock().map(|l| l.clone()).unwrap_or_default();
                    let kernels = if tuning.is_empty() {
                        String::new()
                    } else {
                        format!("; GPU kernels tuned for {tuned} new shapes, latest {tuning}")
                    };
                    tracing::info!("{phase}: {:.0} s{kernels}", started.elapsed().as_secs_f64());
                }
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let (lock, wake) = &*self.stop;
        if let Ok(mut stopped) = lock.lock() {
            *stopped = true;
        }
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Installs the global `tracing` subscriber: lines to stderr, filtered by `BURNLORA_LOG`
/// (default `info`); CubeCL's kernel reports are counted for [`Heartbeat`]s, not printed. Call
/// once, at the start of the program.
pub fn init_logging() -> Result<Logging, ReportError> {
    let filter = EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new("info"));
    let (file, handle) = reload::Layer::new(None::<FileLayer>);
    tracing_subscriber::registry()
        .with(file.with_filter(filter_fn(|m| !from_cubecl(m))))
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(|| Terminal)
                .with_target(false)
                .with_filter(filter_fn(|m| !from_cubecl(m))),
        )
        .with(KernelReports.with_filter(filter_fn(from_cubecl)))
        .with(filter)
        .try_init()
        .map_err(|e| ReportError::Setup(format!("installing the log subscriber: {e}")))?;
    Ok(Logging {
        file: handle,
        guard: Mutex::new(None),
    })
}

impl Logging {
    /// Also writes every log line (without colors) to `path`, appending.
    pub fn add_file(&self, path: &Path) -> Result<(), ReportError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io_error(path))?;
        let (writer, guard) = tracing_appender::non_blocking(file);
        let layer: FileLayer = Box::new(
            tracing_subscriber::fmt::layer()
                .with_writer(writer)
                .with_ansi(false),
        );
        self.file
            .reload(Some(layer))
            .map_err(|e| ReportError::Setup(format!("adding the log file: {e}")))?;
        *self.guard.lock().expect("log guard lock") = Some(guard);
        Ok(())
    }
}

/// An exponential moving average with bias correction (the first value is not pulled to 0).
#[derive(Clone, Copy, Debug)]
pub struct Smoothed {
    decay: f64,
    weighted: f64,
    weight: f64,
}

impl Smoothed {
    /// An average that keeps `decay` of the previous value at each update (0.9: about the last
    /// ten values).
    pub fn new(decay: f64) -> Self {
        Self {
            decay,
            weighted: 0.0,
            weight: 0.0,
        }
    }

    /// Adds a value and returns the average.
    pub fn update(&mut self, value: f64) -> f64 {
        self.weighted = self.decay * self.weighted + (1.0 - self.decay) * value;
        self.weight = self.decay * self.weight + (1.0 - self.decay);
        self.value().expect("updated")
    }

    /// The average, `None` before the first value.
    pub fn value(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.weighted / self.weight)
    }
}

/// The progress bar: step, seconds per step, smoothed loss, learning rate, device memory.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    loss: Smoothed,
    seconds: Smoothed,
}

impl Progress {
    /// A bar for steps `start..total`; hidden when `visible` is false or stderr is not a
    /// terminal.
    pub fn new(total: u64, start: u64, visible: bool) -> Self {
        let target = if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total), target);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix} {bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.set_prefix("train");
        bar.set_position(start);
        bar.enable_steady_tick(Duration::from_millis(500));
        *ACTIVE_BAR.lock().expect("progress bar lock") = Some(bar.clone());
        Self {
            bar,
            loss: Smoothed::new(0.9),
            seconds: Smoothed::new(0.9),
        }
    }

    /// Records a finished step: its number (from 1), loss, learning rate, duration, and a
    /// device memory description (such as `"17.2 GB"`).
    pub fn step(&mut self, step: u64, loss: f64, lr: f64, seconds: f64, memory: &str) {
        let loss = self.loss.update(loss);
        let seconds = self.seconds.update(seconds);
        self.bar.set_position(step);
        self.bar.set_message(format!(
            "{seconds:.2} s/it  loss {loss:.4}  lr {lr:.2e}  mem {memory}"
        ));
    }

    /// The text after the bar (for tests and logs).
    pub fn message(&self) -> String {
        self.bar.message()
    }

    /// Closes the bar, leaving its last state on the terminal.
    pub fn finish(self) {
        self.bar.abandon();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Ok(mut active) = ACTIVE_BAR.lock() {
            *active = None;
        }
    }
}

/// One row of the loss CSV.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossRow {
    /// Optimizer step (from 1).
    pub step: u64,
    /// Training loss of the step.
    pub loss: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Wall time of the step in seconds.
    pub seconds: f64,
}

impl LossRow {
    fn parse(line: &str) -> Option<Self> {
        let mut fields = line.split(',');
        let row = Self {
            step: fields.next()?.parse().ok()?,
            loss: fields.next()?.parse().ok()?,
            lr: fields.next()?.parse().ok()?,
            seconds: fields.next()?.parse().ok()?,
        };
        fields.next().is_none().then_some(row)
    }

    fn line(&self) -> String {
        format!("{},{},{},{}\n", self.step, self.loss, self.lr, self.seconds)
    }
}

/// The loss CSV of a run, and the rows written so far.
#[derive(Debug)]
pub struct LossLog {
    path: PathBuf,
    file: File,
    rows: Vec<LossRow>,
}

impl LossLog {
    /// Opens `<run_dir>/loss.csv` for a run that continues after step `resumed_at` (0 for a
    /// new run): rows of later steps (from the interrupted part of a previous run) are dropped,
    /// as are lines that do not parse; the file is rewritten atomically.
    pub fn open(run_dir: &Path, resumed_at: u64) -> Result<Self, ReportError> {
        let path = run_dir.join(LOSS_CSV);
        let rows: Vec<LossRow> = match std::fs::read_to_string(&path) {
            Ok(text) => text
                .lines()
                .filter_map(LossRow::parse)
                .filter(|r| r.step <= resumed_at)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_error(&path)(e)),
        };
        write_atomically(&path, |tmp| -> Result<(), ReportError> {
            let mut text = format!("{CSV_HEADER}\n");
            rows.iter().for_each(|r| text.push_str(&r.line()));
            std::fs::write(tmp, text).map_err(io_error(tmp))
        })?;
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(io_error(&path))?;
        Ok(Self { path, file, rows })
    }

    /// Appends a row (one `write` call, so a crash leaves at most a torn last line).
    pub fn append(&mut self, row: LossRow) -> Result<(), ReportError> {
        self.file
            .write_all(row.line().as_bytes())
            .map_err(io_error(&self.path))?;
        self.rows.push(row);
        Ok(())
    }

    /// Flushes the rows to disk (call at each checkpoint).
    pub fn sync(&self) -> Result<(), ReportError> {
        self.file.sync_data().map_err(io_error(&self.path))
    }

    /// Every row, in step order.
    pub fn rows(&self) -> &[LossRow] {
        &self.rows
    }
}

static FONT_REGISTERED: Once = Once::new();

/// Draws the loss curve (raw and smoothed) to `path` (PNG, 1000×500), atomically.
pub fn plot_loss(rows: &[LossRow], path: &Path) -> Result<(), ReportError> {
    FONT_REGISTERED.call_once(|| {
        // The font is compiled in and valid; registration only fails on an unreadable font.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let (width, height) = (1000u32, 500u32);
    let mut pixels = vec![0u8; (width * height * 3) as usize];
    let plot_error = |e: &dyn std::fmt::Display| ReportError::Plot {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_error(&e))?;
        let finite: Vec<&LossRow> = rows.iter().filter(|r| r.loss.is_finite()).collect();
        let first = finite.first().map_or(0, |r| r.step);
        let last = finite.last().map_or(1, |r| r.step).max(first + 1);
        let (low, high) = finite.iter().fold((f64::MAX, f64::MIN), |(lo, hi), r| {
            (lo.min(r.loss), hi.max(r.loss))
        });
        let (low, high) = if finite.is_empty() {
            (0.0, 1.0)
        } else {
            let pad = ((high - low) * 0.05).max(1e-6);
            (low - pad, high + pad)
        };
        let mut chart = ChartBuilder::on(&root)
            .caption("training loss", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(first..last, low..high)
            .map_err(|e| plot_error(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| plot_error(&e))?;
        chart
            .draw_series(LineSeries::new(
                finite.iter().map(|r| (r.step, r.loss)),
                RGBColor(170, 190, 230),
            ))
            .map_err(|e| plot_error(&e))?;
        let mut smooth = Smoothed::new(0.95);
        chart
            .draw_series(LineSeries::new(
                finite.iter().map(|r| (r.step, smooth.update(r.loss))),
                RGBColor(20, 60, 160).stroke_width(2),
            ))
            .map_err(|e| plot_error(&e))?;
        root.present().map_err(|e| plot_error(&e))?;
    }
    write_atomically(path, |tmp| -> Result<(), ReportError> {
        image::save_buffer_with_format(
            tmp,
            &pixels,
            width,
            height,
            image::ExtendedColorType::Rgb8,
            image::ImageFormat::Png,
        )
        .map_err(|e| plot_error(&e))
    })
}

/// Set by Ctrl-C; the training loop polls it and stops with a checkpoint.
#[derive(Clone, Debug, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// Installs the Ctrl-C handler (once per process): the first Ctrl-C sets the flag, a second
    /// one exits at once with status 130.
    pub fn install() -> Result<Self, ReportError> {
        let flag = Self::default();
        let set = flag.0.clone();
        ctrlc::set_handler(move || {
            if set.swap(true, Ordering::SeqCst) {
                eprintln!("second interrupt: exiting without a checkpoint");
                std::process::exit(130);
            }
            tracing::warn!(
                "interrupt: stopping after this step with a checkpoint (Ctrl-C again to quit now)"
            );
        })
        .map_err(|e| ReportError::Setup(format!("installing the Ctrl-C handler: {e}")))?;
        Ok(flag)
    }

    /// Whether a stop was requested.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cubecl_tuning_reports_are_followed_and_other_events_ignored() {
        let subscriber =
            tracing_subscriber::registry().with(KernelReports.with_filter(filter_fn(from_cubecl)));
        let before = TUNED.load(Ordering::Relaxed);
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(
                target: "cubecl_runtime::tune::tuner",
                "Tuning MatmulAutotuneKey - m: 512, n: 512, k: 64"
            );
            tracing::info!(
                target: "cubecl_runtime::tune::tuner",
                "Fastest result matmul_simple-MatmulAutotuneKey - m: 512. \n Top 3 times: []"
            );
            tracing::info!(target: "burn_lora_train", "Tuning is not CubeCL's here");
        });
        assert_eq!(TUNED.load(Ordering::Relaxed) - before, 1);
        assert_eq!(
            *TUNING.lock().unwrap(),
            "MatmulAutotuneKey - m: 512, n: 512, k: 64"
        );
    }

    #[test]
    fn smoothing_is_an_exponential_average_without_startup_bias() {
        let mut s = Smoothed::new(0.5);
        assert_eq!(s.value(), None);
        assert_eq!(s.update(4.0), 4.0);
        // (0.5·0.5·4 + 0.5·2) / (0.5·0.5 + 0.5) = 2/0.75
        assert!((s.update(2.0) - 2.0 / 0.75).abs() < 1e-12);
    }

    #[test]
    fn progress_message_shows_smoothed_loss_lr_speed_and_memory() {
        let mut p = Progress::new(100, 0, false);
        p.step(1, 1.0, 1e-4, 2.0, "3.1 GB");
        p.step(2, 0.0, 1e-4, 2.0, "3.1 GB");
        // Decay 0.9: (0.09·1 + 0.1·0) / 0.19 = 0.4737
        assert_eq!(
            p.message(),
            "2.00 s/it  loss 0.4737  lr 1.00e-4  mem 3.1 GB"
        );
    }

    #[test]
    fn loss_csv_drops_rows_past_the_resume_point_and_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LossLog::open(dir.path(), 0).unwrap();
        for step in 1..=6 {
            log.append(LossRow {
                step,
                loss: 1.0 / step as f64,
                lr: 1e-4,
                seconds: 0.5,
            })
            .unwrap();
        }
        drop(log);
        // A crash in the middle of a write leaves a torn last line.
        let csv = dir.path().join(LOSS_CSV);
        let mut file = OpenOptions::new().append(true).open(&csv).unwrap();
        file.write_all(b"7,0.14").unwrap();
        let log = LossLog::open(dir.path(), 4).unwrap();
        assert_eq!(
            log.rows().iter().map(|r| r.step).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        assert_eq!(log.rows()[1].loss, 0.5);
        let text = std::fs::read_to_string(&csv).unwrap();
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        assert_eq!(text.lines().count(), 5);
    }

    #[test]
    fn loss_plot_is_a_png_with_the_curve_drawn() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<LossRow> = (1..=200)
            .map(|step| LossRow {
                step,
                loss: 1.0 / (1.0 + step as f64 / 20.0),
                lr: 1e-4,
                seconds: 1.0,
            })
            .collect();
        let path = dir.path().join(LOSS_PNG);
        plot_loss(&rows, &path).unwrap();
        let image = image::open(&path).unwrap().to_rgb8();
        assert_eq!(image.dimensions(), (1000, 500));
        // The smoothed curve's color appears, and so does dark text (axis labels).
        let has = |f: &dyn Fn(&image::Rgb<u8>) -> bool| image.pixels().any(f);
        assert!(has(&|p| p.0 == [20, 60, 160]));
        assert!(has(&|p| p.0[0] < 60 && p.0[1] < 60 && p.0[2] < 60));
    }
}
