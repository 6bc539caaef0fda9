//! A change run's keys or values: byte strings side by side in one buffer.
//!
//! A run of 512 changes made 1,024 `bytes` objects (a key and a value each) that lived only
//! until the record batch copied them: the allocations, list slots and frees were a tenth of
//! the producer's CPU (docs/producer.md, stop 34). `RecordBatchBuilder.extend` copies from
//! `Records` directly; Python code that reads one (an error message, an incremental
//! snapshot's watch, a test) gets `bytes` made on demand, through the sequence protocol.

use pyo3::basic::CompareOp;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// A Python sequence's index (negative: from the end) as a position below `len`.
pub(crate) fn sequence_index(index: isize, len: usize, what: &str) -> PyResult<usize> {
    let i = if index < 0 { index + len as isize } else { index };
    if i < 0 || i >= len as isize {
        return Err(PyIndexError::new_err(format!("{what} index out of range")));
    }
    Ok(i as usize)
}

#[pyclass(frozen, sequence, module = "walbus_native")]
#[derive(Default, PartialEq, Eq)]
pub struct Records {
    data: Vec<u8>,
    /// Where each byte string ends in `data` (the next one starts there).
    ends: Vec<usize>,
}

impl Records {
    pub(crate) fn push(&mut self, item: &[u8]) {
        self.data.extend_from_slice(item);
        self.ends.push(self.data.len());
    }

    pub(crate) fn count(&self) -> usize {
        self.ends.len()
    }

    pub(crate) fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.data[start..self.ends[i]]
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, (0..self.count()).map(|i| PyBytes::new(py, self.get(i))))
    }
}

#[pymethods]
impl Records {
    /// Records holding `items` (the native encoders make them; this is for tests and callers
    /// that have a list).
    #[new]
    fn from_list(items: Vec<Bound<'_, PyBytes>>) -> Self {
        let mut records = Records::default();
        for item in &items {
            records.push(item.as_bytes());
        }
        records
    }

    fn __len__(&self) -> usize {
        self.count()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: isize) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, self.get(sequence_index(index, self.count(), "Records")?)))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.items(py)?.try_iter()?.into_any())
    }

    /// The byte strings as a list of `bytes`.
    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.items(py)
    }

    /// The length of the longest byte string (0 when there is none).
    fn max_len(&self) -> usize {
        (0..self.count()).map(|i| self.get(i).len()).max().unwrap_or(0)
    }

    /// Equal to other `Records` with the same byte strings, or to a list that equals theirs.
    fn __richcmp__<'py>(&self, other: &Bound<'py, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
        let py = other.py();
        let equal = match other.cast::<Records>() {
            Ok(theirs) => *self == *theirs.get(),
            Err(_) if other.is_instance_of::<PyList>() => self.items(py)?.eq(other)?,
            Err(_) => return Ok(py.NotImplemented()),
        };
        match op {
            CompareOp::Eq => Ok(equal.into_pyobject(py)?.to_owned().into_any().unbind()),
            CompareOp::Ne => Ok((!equal).into_pyobject(py)?.to_owned().into_any().unbind()),
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __repr__(&self) -> String {
        format!("<Records of {} byte strings, {} bytes>", self.count(), self.data.len())
    }
}
