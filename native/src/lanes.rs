//! The lane of an event in `Feed.run(handler, concurrency=N)`: the hash of its order key
//! modulo N, the consumers' per-event dispatch (~1 µs a event in Python, most of run(8)'s
//! overhead over a plain loop).
//!
//! A leaf like the decoders: the caller names the event's and the row image's attributes and
//! the two operations that matter; this code spells none of them. It computes exactly
//! `walbus.client.parallel.order_key` and `hash(key) % N`: the same tuple, hashed by Python.
//! What it cannot take (an attribute of another type, a key that cannot be hashed) raises
//! TypeError, and the caller takes its Python path, which decides.

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

// Column positions kept, by (columns, key columns) identity; beyond, the memory starts again.
const POSITIONS_LIMIT: usize = 256;

type Positions = Option<Vec<usize>>;
type Known = HashMap<(usize, usize), (Py<PyTuple>, Py<PyTuple>, Positions)>;

#[pyclass(frozen, module = "walbus_native")]
pub struct OrderLanes {
    operation: Py<PyString>,
    pk: Py<PyString>,
    table: Py<PyString>,
    new: Py<PyString>,
    identity: Py<PyString>,
    columns: Py<PyString>,
    values: Py<PyString>,
    barrier: Py<PyString>, // an event of this operation has no key of its own
    rekey: Py<PyString>,   // one of this operation whose old key differs is a barrier too
    // The references keep the tuples alive, so their identity cannot be reused by another.
    positions: Mutex<Known>,
}

fn pick<'py>(names: &[Bound<'py, PyString>], i: usize) -> Py<PyString> {
    names[i].clone().unbind()
}

/// `a == b` for the caller's strings: by identity first (the decoder shares its strings).
fn same(a: &Bound<'_, PyAny>, b: &Bound<'_, PyString>) -> PyResult<bool> {
    Ok(a.is(b) || a.eq(b)?)
}

#[pymethods]
impl OrderLanes {
    /// `event_attrs`: operation, pk, table, new, identity; `image_attrs`: columns, values;
    /// `barrier` and `rekey`: the operation names of a truncate and of an update.
    #[new]
    fn new(event_attrs: Vec<Bound<'_, PyString>>, image_attrs: Vec<Bound<'_, PyString>>, barrier: Bound<'_, PyString>, rekey: Bound<'_, PyString>) -> PyResult<Self> {
        if event_attrs.len() != 5 || image_attrs.len() != 2 {
            return Err(PyValueError::new_err("OrderLanes: 5 event attributes and 2 image attributes"));
        }
        Ok(OrderLanes {
            operation: pick(&event_attrs, 0),
            pk: pick(&event_attrs, 1),
            table: pick(&event_attrs, 2),
            new: pick(&event_attrs, 3),
            identity: pick(&event_attrs, 4),
            columns: pick(&image_attrs, 0),
            values: pick(&image_attrs, 1),
            barrier: barrier.unbind(),
            rekey: rekey.unbind(),
            positions: Mutex::new(HashMap::new()),
        })
    }

    /// The event's lane among `lanes`, or None for a barrier.
    fn lane(&self, event: &Bound<'_, PyAny>, lanes: isize) -> PyResult<Option<isize>> {
        if lanes < 1 {
            return Err(PyValueError::new_err("OrderLanes: lanes must be at least 1"));
        }
        // Python's `%` with a positive divisor: never negative, as rem_euclid.
        self.key(event)?.map(|key| key.hash().map(|h| h.rem_euclid(lanes))).transpose()
    }

    /// The event's order key (what `order_key` gives), or None for a barrier.
    fn key<'py>(&self, event: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = event.py();
        let operation = event.getattr(self.operation.bind(py))?;
        if same(&operation, self.barrier.bind(py))? {
            return Ok(None);
        }
        let pk = event.getattr(self.pk.bind(py))?.cast_into::<PyTuple>()?;
        let table = event.getattr(self.table.bind(py))?;
        if pk.is_empty() {
            return Ok(Some(PyTuple::new(py, [table])?));
        }
        let new = event.getattr(self.new.bind(py))?;
        let identity = event.getattr(self.identity.bind(py))?;
        if !new.is_none() {
            if let Some(key) = self.key_in(&new, &pk, &table)? {
                if !identity.is_none() && same(&operation, self.rekey.bind(py))? {
                    if let Some(old) = self.key_in(&identity, &pk, &table)? {
                        if old.ne(&key)? {
                            return Ok(None); // the key changed: ordered with both keys' events
                        }
                    }
                }
                return Ok(Some(key));
            }
            if same(&operation, self.rekey.bind(py))? {
                return Ok(None); // a key column's unchanged TOAST value is not in the row
            }
        }
        if !identity.is_none() {
            if let Some(key) = self.key_in(&identity, &pk, &table)? {
                return Ok(Some(key));
            }
        }
        Ok(Some(PyTuple::new(py, [table])?))
    }
}

impl OrderLanes {
    /// `(table, *the values of pk's columns in image)`; None when one is missing.
    fn key_in<'py>(&self, image: &Bound<'py, PyAny>, pk: &Bound<'py, PyTuple>, table: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = image.py();
        let columns = image.getattr(self.columns.bind(py))?.cast_into::<PyTuple>()?;
        let values = image.getattr(self.values.bind(py))?.cast_into::<PyTuple>()?;
        let build = |positions: &[usize]| -> PyResult<Bound<'py, PyTuple>> {
            let mut items = Vec::with_capacity(positions.len() + 1);
            items.push(table.clone());
            for &i in positions {
                items.push(values.get_item(i)?);
            }
            PyTuple::new(py, items)
        };
        let ident = (columns.as_ptr() as usize, pk.as_ptr() as usize);
        let poisoned = || PyValueError::new_err("walbus_native: positions poisoned");
        {
            // Building the tuple runs no Python code: safe under the lock.
            let known = self.positions.lock().map_err(|_| poisoned())?;
            if let Some((_, _, found)) = known.get(&ident) {
                return found.as_deref().map(build).transpose();
            }
        }
        // Found outside the lock: comparing names may run Python code.
        let found = positions_of(&columns, pk)?;
        let key = found.as_deref().map(build).transpose()?;
        let mut known = self.positions.lock().map_err(|_| poisoned())?;
        if known.len() >= POSITIONS_LIMIT {
            known.clear();
        }
        known.insert(ident, (columns.unbind(), pk.clone().unbind(), found));
        Ok(key)
    }
}

/// Where each of `pk`'s columns is in `columns` (the last of a repeated name, as
/// `RowImage.as_dict`); None when one is missing.
fn positions_of(columns: &Bound<'_, PyTuple>, pk: &Bound<'_, PyTuple>) -> PyResult<Positions> {
    let mut found = Vec::with_capacity(pk.len());
    for name in pk.iter() {
        let mut at = None;
        for (i, column) in columns.iter().enumerate().rev() {
            if column.is(&name) || column.eq(&name)? {
                at = Some(i);
                break;
            }
        }
        match at {
            Some(i) => found.push(i),
            None => return Ok(None),
        }
    }
    Ok(Some(found))
}
