//! A replication stream's CopyData messages taken from libpq in one call: the producer's reads.
//!
//! A leaf like the tuple decoder: it calls the two libpq functions the caller hands it (the
//! addresses of `PQgetCopyData` and `PQfreemem` in the libpq that made the connection) on the
//! connection the caller names, and splits the streaming protocol's two messages: XLogData
//! (`w`: its start position and payload) and the primary keepalive (`k`: the server's WAL end
//! and whether it asks for a reply). It never waits: asynchronous reads only.

use std::ffi::{c_char, c_int, c_void};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::messages::Messages;

type GetCopyData = unsafe extern "C" fn(*mut c_void, *mut *mut c_char, c_int) -> c_int;
type FreeMem = unsafe extern "C" fn(*mut c_void);

const XLOG_DATA: u8 = b'w';
const KEEPALIVE: u8 = b'k';
const XLOG_HEADER: usize = 1 + 8 + 8 + 8; // kind, data start, WAL end, send time
const KEEPALIVE_LEN: usize = 1 + 8 + 8 + 1; // kind, WAL end, send time, reply requested

/// Statuses of `CopyReader::read`, as libpq's `PQgetCopyData` gives them (0: nothing more
/// without reading the socket, -1: the COPY ended, -2: an error), 1: `limit` reached, and 2:
/// an XLogData or keepalive message too short for its header (left unread: the caller fails).
const LIMIT: i32 = 1;
const MALFORMED: i32 = 2;

#[pyclass(frozen, module = "walbus_native")]
pub struct CopyReader {
    get_copy_data: GetCopyData,
    freemem: FreeMem,
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_be_bytes(b)
}

#[pymethods]
impl CopyReader {
    /// `get_copy_data` and `freemem`: the addresses of `PQgetCopyData` and `PQfreemem` in the
    /// libpq whose connections `read` is given (the caller checks they are that library's).
    #[new]
    fn new(get_copy_data: usize, freemem: usize) -> PyResult<Self> {
        if get_copy_data == 0 || freemem == 0 {
            return Err(PyValueError::new_err("CopyReader: a libpq function address is null"));
        }
        // SAFETY: the caller passes the addresses of these two libpq functions, whose C
        // signatures are the types above.
        unsafe {
            Ok(CopyReader {
                get_copy_data: std::mem::transmute::<usize, GetCopyData>(get_copy_data),
                freemem: std::mem::transmute::<usize, FreeMem>(freemem),
            })
        }
    }

    /// Up to `limit` XLogData messages available on the connection `pgconn` (a `PGconn *` in
    /// COPY BOTH mode, as psycopg's `pgconn.pgconn_ptr`) without waiting, appended to `out` as
    /// `(data start, payload)`. Returns `(status, highest keepalive WAL end or 0, whether a
    /// keepalive asked for a reply)`; status 0, -1 and -2 as `PQgetCopyData`, 1 at the limit.
    fn read<'py>(&self, py: Python<'py>, pgconn: usize, out: &Bound<'py, PyAny>, limit: usize) -> PyResult<Bound<'py, PyTuple>> {
        if pgconn == 0 {
            return Err(PyValueError::new_err("CopyReader.read: no connection"));
        }
        // Into `Messages` (one buffer, no object a message), or a list of tuples.
        let mut native = match out.cast::<Messages>() {
            Ok(m) => Some(m.try_borrow_mut()?),
            Err(_) => None,
        };
        let list = if native.is_none() { Some(out.cast::<PyList>()?) } else { None };
        let conn = pgconn as *mut c_void;
        let (mut wal_end, mut reply) = (0u64, false);
        let mut taken = 0usize;
        let status = loop {
            if taken >= limit {
                break LIMIT;
            }
            let mut buf: *mut c_char = std::ptr::null_mut();
            // SAFETY: conn is a live PGconn (the caller's open replication connection); async
            // mode (1) never blocks; on n > 0 buf holds n bytes that we free with PQfreemem.
            let n = unsafe { (self.get_copy_data)(conn, &mut buf, 1) };
            if n <= 0 {
                break n;
            }
            // SAFETY: as above: n bytes at buf, freed once just below, after the last use.
            let data = unsafe { std::slice::from_raw_parts(buf.cast::<u8>().cast_const(), n as usize) };
            let item = match data.first() {
                Some(&XLOG_DATA) if data.len() >= XLOG_HEADER => Some((u64_at(data, 1), &data[XLOG_HEADER..])),
                Some(&KEEPALIVE) if data.len() >= KEEPALIVE_LEN => {
                    wal_end = wal_end.max(u64_at(data, 1));
                    reply |= data[KEEPALIVE_LEN - 1] != 0;
                    None
                }
                Some(&XLOG_DATA) | Some(&KEEPALIVE) => {
                    // SAFETY: buf came from PQgetCopyData and is freed exactly once.
                    unsafe { (self.freemem)(buf.cast::<c_void>()) };
                    break MALFORMED;
                }
                _ => None, // anything else the server may add to the protocol: not ours
            };
            let appended = match (item, native.as_mut(), list) {
                (Some((start, payload)), Some(messages), _) => {
                    messages.push(start, payload);
                    Ok(true)
                }
                (Some((start, payload)), None, Some(list)) => list.append((start, PyBytes::new(py, payload))).map(|()| true),
                _ => Ok(false),
            };
            // SAFETY: buf came from PQgetCopyData and is freed exactly once, after its last use.
            unsafe { (self.freemem)(buf.cast::<c_void>()) };
            if appended? {
                taken += 1;
            }
        };
        (status, wal_end, reply).into_pyobject(py)
    }
}
