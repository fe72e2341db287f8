//! A small fixed thread pool for the requests that wait: for durability
//! (fsync, fsyncdir) or for the device (a READ the daemon's cache does not
//! hold whole). An event loop hands the request (with its reply object) to a
//! worker and goes back to reading, so commits and reads in flight never
//! occupy every event loop. FIFO: with more fsyncs waiting than workers
//! (`fsync_threads`, at least 32), a cold READ waits for a worker too.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

pub(crate) type Job<S> = Box<dyn FnOnce(&S) + Send + 'static>;

pub(crate) struct Pool<S: Send + Sync + 'static> {
    tx: Option<Sender<Job<S>>>,
    workers: Vec<JoinHandle<()>>,
    state: Arc<S>,
}

impl<S: Send + Sync + 'static> Pool<S> {
    pub(crate) fn new(state: Arc<S>, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job<S>>();
        let rx = Arc::new(Mutex::new(rx));
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let st = state.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("commitfs-w{i}"))
                    .spawn(move || worker(rx, st))?,
            );
        }
        Ok(Pool {
            tx: Some(tx),
            workers,
            state,
        })
    }

    /// Queue a job; after [`Pool::shutdown`] it runs on the caller's thread.
    pub(crate) fn submit(&self, job: Job<S>) {
        match &self.tx {
            Some(tx) => {
                if let Err(e) = tx.send(job) {
                    run_job(e.0, &self.state);
                }
            }
            None => run_job(job, &self.state),
        }
    }

    /// Finish queued jobs and join the workers.
    pub(crate) fn shutdown(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                tracing::error!("a FUSE worker thread panicked");
            }
        }
    }
}

impl<S: Send + Sync + 'static> Drop for Pool<S> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker<S>(rx: Arc<Mutex<Receiver<Job<S>>>>, st: Arc<S>) {
    loop {
        // Hold the lock only while waiting for the next job.
        let job = rx.lock().recv();
        match job {
            Ok(job) => run_job(job, &st),
            Err(_) => return,
        }
    }
}

/// Run one job; a panic is logged and its dropped reply answers EIO.
fn run_job<S>(job: Job<S>, st: &S) {
    if catch_unwind(AssertUnwindSafe(|| job(st))).is_err() {
        tracing::error!("FUSE request handler panicked (answered EIO)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    #[test]
    fn slow_job_does_not_block_others() {
        let st = Arc::new(AtomicUsize::new(0));
        let mut p = Pool::new(st.clone(), 3).unwrap();
        let (done_tx, done_rx) = channel();
        // The slow job holds its worker until the others are done: if it
        // blocked them, they would time out below.
        let (release_tx, release_rx) = channel::<()>();
        let release_rx = Mutex::new(release_rx);
        p.submit(Box::new(move |_| {
            let _ = release_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30));
        }));
        for _ in 0..10 {
            let d = done_tx.clone();
            p.submit(Box::new(move |s: &AtomicUsize| {
                s.fetch_add(1, Ordering::SeqCst);
                d.send(()).unwrap();
            }));
        }
        for _ in 0..10 {
            done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        }
        release_tx.send(()).unwrap();
        p.shutdown();
        assert_eq!(st.load(Ordering::SeqCst), 10);
        // After shutdown jobs run inline.
        p.submit(Box::new(|s: &AtomicUsize| {
            s.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(st.load(Ordering::SeqCst), 11);
    }

    #[test]
    fn panicking_job_keeps_worker_alive() {
        let st = Arc::new(AtomicUsize::new(0));
        let mut p = Pool::new(st.clone(), 1).unwrap();
        p.submit(Box::new(|_| panic!("boom")));
        p.submit(Box::new(|s: &AtomicUsize| {
            s.fetch_add(1, Ordering::SeqCst);
        }));
        p.shutdown();
        assert_eq!(st.load(Ordering::SeqCst), 1);
    }
}
