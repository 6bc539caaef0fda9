//! A Kafka record batch (magic 2, uncompressed or LZ4) built from runs of records: the
//! producer's appends, without a Python call per record.
//!
//! LZ4 as Kafka's clients write it: the LZ4 frame format, 64 KB independent blocks, no block
//! or content checksum, no content size (the batch's CRC-32C covers the compressed bytes).
//!
//! A leaf: it knows the record batch layout of Kafka's protocol (KIP-98) and nothing of topics
//! or producers. The caller (walbus.aiokafka_shortcuts.NativeBatch) puts it where aiokafka's
//! own builder would be; aiokafka's sender sets the producer state and takes the built bytes.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use lz4_flex::frame::{BlockMode, BlockSize, FrameEncoder, FrameInfo};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::records::Records;

/// The batch header: base offset, length, leader epoch, magic, crc, attributes, last offset
/// delta, first and max timestamp, producer id, producer epoch, base sequence, record count.
const HEADER: usize = 8 + 4 + 4 + 1 + 4 + 2 + 4 + 8 + 8 + 8 + 2 + 4 + 4;
const CRC_AT: usize = 8 + 4 + 4 + 1;
const ATTRIBUTES_AT: usize = CRC_AT + 4;
const TRANSACTIONAL: i16 = 0x10;
/// Kafka's compression codec ids (a batch's attributes, bits 0-2).
const NONE: u8 = 0;
const LZ4: u8 = 3;
const NO_PARTITION_LEADER_EPOCH: i32 = -1;

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn varint_len(v: i64) -> usize {
    let mut z = zigzag(v);
    let mut n = 1;
    while z >= 0x80 {
        z >>= 7;
        n += 1;
    }
    n
}

fn push_varint(out: &mut Vec<u8>, v: i64) {
    let mut z = zigzag(v);
    while z >= 0x80 {
        out.push((z as u8) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[pyclass(module = "walbus_native")]
pub struct RecordBatchBuilder {
    buf: Vec<u8>,
    limit: usize,
    count: i32,
    first_timestamp: i64,
    transactional: bool,
    compression: u8,
    /// Built compressed: `buf` holds the header and the LZ4 frame, not the records.
    packed: bool,
    producer: (i64, i16, i32),
}

impl RecordBatchBuilder {
    /// Append one record (timestamp delta 0: a batch's records share its first timestamp);
    /// false when it does not fit and the batch has one already (an empty batch takes any).
    fn push(&mut self, key: Option<&[u8]>, value: Option<&[u8]>) -> bool {
        if self.packed {
            return false; // built: closed
        }
        let offset_delta = i64::from(self.count);
        let field = |b: Option<&[u8]>| b.map_or(1, |b| varint_len(b.len() as i64) + b.len());
        // attributes, timestamp delta (0), offset delta, key, value, header count (0)
        let body = 1 + 1 + varint_len(offset_delta) + field(key) + field(value) + 1;
        // As aiokafka's builder: a record that would bring the batch to its limit is refused too.
        if self.count > 0 && self.buf.len() + varint_len(body as i64) + body >= self.limit {
            return false;
        }
        if self.count == 0 {
            self.first_timestamp = now_ms();
        }
        let buf = &mut self.buf;
        push_varint(buf, body as i64);
        buf.push(0);
        buf.push(0);
        push_varint(buf, offset_delta);
        for part in [key, value] {
            match part {
                Some(b) => {
                    push_varint(buf, b.len() as i64);
                    buf.extend_from_slice(b);
                }
                None => push_varint(buf, -1),
            }
        }
        buf.push(0);
        self.count += 1;
        true
    }
}

fn optional_bytes<'a>(item: &'a Bound<'_, PyAny>) -> PyResult<Option<&'a [u8]>> {
    if item.is_none() {
        return Ok(None);
    }
    Ok(Some(item.cast::<PyBytes>()?.as_bytes()))
}

#[pymethods]
impl RecordBatchBuilder {
    /// An empty batch of at most `batch_size` bytes before compression (a first record of
    /// any size is taken); `compression`: Kafka's codec id, 0 (none) or 3 (LZ4).
    #[new]
    #[pyo3(signature = (batch_size, transactional, compression = 0))]
    fn new(batch_size: usize, transactional: bool, compression: u8) -> PyResult<Self> {
        if compression != NONE && compression != LZ4 {
            return Err(PyValueError::new_err(format!("RecordBatchBuilder: compression {compression} is not built here")));
        }
        Ok(RecordBatchBuilder {
            buf: vec![0; HEADER],
            limit: batch_size,
            count: 0,
            first_timestamp: 0,
            transactional,
            compression,
            packed: false,
            producer: (-1, -1, 0),
        })
    }

    /// Append one record; false when the batch is full.
    #[pyo3(signature = (key, value))]
    fn append(&mut self, key: Option<&[u8]>, value: Option<&[u8]>) -> bool {
        self.push(key, value)
    }

    /// Append `zip(keys, values)[start:]` (lists of bytes or None each, or a change run's
    /// `Records`) until the batch is full; how many it took.
    fn extend(&mut self, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>, start: usize) -> PyResult<usize> {
        if let (Ok(keys), Ok(values)) = (keys.cast::<Records>(), values.cast::<Records>()) {
            // A change run's: copied from its buffers, no object each.
            let (keys, values) = (keys.get(), values.get());
            let end = keys.count().min(values.count());
            let mut i = start;
            while i < end && self.push(Some(keys.get(i)), Some(values.get(i))) {
                i += 1;
            }
            return Ok(i.saturating_sub(start));
        }
        let (keys, values) = (keys.cast::<PyList>()?, values.cast::<PyList>()?);
        let end = keys.len().min(values.len());
        let mut i = start;
        while i < end {
            let (k, v) = (keys.get_item(i)?, values.get_item(i)?);
            if !self.push(optional_bytes(&k)?, optional_bytes(&v)?) {
                break;
            }
            i += 1;
        }
        Ok(i.saturating_sub(start))
    }

    /// The batch's size in bytes as built.
    fn size(&self) -> usize {
        self.buf.len()
    }

    fn record_count(&self) -> i32 {
        self.count
    }

    /// The idempotent producer's id, epoch and the batch's first sequence number (aiokafka's
    /// sender sets them when it takes the batch).
    fn set_producer_state(&mut self, producer_id: i64, producer_epoch: i16, base_sequence: i32) {
        self.producer = (producer_id, producer_epoch, base_sequence);
    }

    /// The batch's bytes, header and CRC-32C included (its records compressed, if asked).
    fn build<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        if self.count == 0 {
            return Err(PyValueError::new_err("RecordBatchBuilder.build: an empty batch"));
        }
        if self.compression == LZ4 && !self.packed {
            let mut out = Vec::with_capacity(HEADER + self.buf.len() / 2);
            out.resize(HEADER, 0);
            let info = FrameInfo::new().block_size(BlockSize::Max64KB).block_mode(BlockMode::Independent);
            let mut frame = FrameEncoder::with_frame_info(info, out);
            frame.write_all(&self.buf[HEADER..]).map_err(|e| PyValueError::new_err(format!("LZ4: {e}")))?;
            self.buf = frame.finish().map_err(|e| PyValueError::new_err(format!("LZ4: {e}")))?;
            self.packed = true; // buf holds the frame now: no more appends, no second compression
        }
        let len = self.buf.len();
        let (producer_id, epoch, base_sequence) = self.producer;
        let mut attributes: i16 = if self.transactional { TRANSACTIONAL } else { 0 };
        attributes |= i16::from(self.compression);
        let mut h: Vec<u8> = Vec::with_capacity(HEADER);
        h.extend_from_slice(&0i64.to_be_bytes()); // base offset: the broker's
        h.extend_from_slice(&((len - 12) as i32).to_be_bytes());
        h.extend_from_slice(&NO_PARTITION_LEADER_EPOCH.to_be_bytes());
        h.push(2); // magic
        h.extend_from_slice(&0u32.to_be_bytes()); // crc, below
        h.extend_from_slice(&attributes.to_be_bytes());
        h.extend_from_slice(&(self.count - 1).to_be_bytes());
        h.extend_from_slice(&self.first_timestamp.to_be_bytes());
        h.extend_from_slice(&self.first_timestamp.to_be_bytes()); // max: every record has the first's
        h.extend_from_slice(&producer_id.to_be_bytes());
        h.extend_from_slice(&epoch.to_be_bytes());
        h.extend_from_slice(&base_sequence.to_be_bytes());
        h.extend_from_slice(&self.count.to_be_bytes());
        self.buf[..HEADER].copy_from_slice(&h);
        let crc = crc32c::crc32c(&self.buf[ATTRIBUTES_AT..]);
        self.buf[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_be_bytes());
        Ok(PyBytes::new(py, &self.buf))
    }
}
