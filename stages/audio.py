"""A clip's audio: the window of a video's sound track under a clip's frames, and its log-mel spectrogram.

A family with an audio stream (LTX-2) gets, for each clip, the samples of the source video's first audio track
that play while the clip's frames are shown: from the time of the clip's first frame, for ``num_frames / fps``
seconds (the span the pipeline generates for that many frames). The track is decoded with PyAV and resampled by
FFmpeg's resampler to the rate and channel count the family's audio encoder takes, whatever the source's rate
(8 kHz to 96 kHz, mono or 5.1 alike). A video without an audio track gives silence (zeros): see
``docs/cache-format.md``, "Audio".
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch


def clip_span(meta: dict[str, Any]) -> tuple[float, float]:
    """(start, duration) in seconds of a bucketed clip sample's window in its source video.

    The start is the first frame's time: its presentation time for a variable-frame-rate video, its index over
    the source's rate otherwise; the duration is ``num_frames / fps`` of the clip (its output rate).
    """
    clip = meta["clip"]
    first = int(clip["frame_indices"][0])
    if meta.get("vfr"):
        from latentmill.stages.video import frame_times

        times = frame_times(meta["source_uri"])
        start = times[first] - times[0]
    else:
        start = first / float(meta["fps"])
    return float(start), int(clip["num_frames"]) / float(clip["fps"])


def read_audio(uri: str | bytes, spans: list[tuple[float, float]], sample_rate: int,
               channels: int = 2) -> tuple[list[torch.Tensor], bool]:
    """The windows ``spans`` ((start, duration) seconds from the track's first sample) of a video's first audio
    track, each ``[channels, round(duration * sample_rate)]`` float32 resampled to ``sample_rate``, in one pass
    over the track; and whether the video has an audio track (without one: zeros, False). A window the track
    ends inside is padded with zeros."""
    from latentmill.stages.video import open_media

    windows = [(round(start * sample_rate), np.zeros((channels, round(duration * sample_rate)), np.float32))
               for start, duration in spans]
    end = max((first + out.shape[1] for first, out in windows), default=0)
    layout = {1: "mono", 2: "stereo"}[channels]
    with open_media(uri) as container:
        if not container.streams.audio:
            return [torch.from_numpy(out) for _, out in windows], False
        import av

        resampler = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate)
        at = 0  # samples of the resampled track seen so far
        for frame in container.decode(audio=0):
            for chunk in resampler.resample(frame):
                at = _place(windows, chunk.to_ndarray(), at)
            if at >= end:
                break
        else:
            for chunk in resampler.resample(None):  # the resampler's buffered tail
                at = _place(windows, chunk.to_ndarray(), at)
    return [torch.from_numpy(out) for _, out in windows], True


def _place(windows: list[tuple[int, np.ndarray]], samples_CN: np.ndarray, at: int) -> int:
    """Copy the track's samples from ``at`` into the windows they fall in; returns where the next ones start."""
    for first, out in windows:
        lo, hi = max(at, first), min(at + samples_CN.shape[1], first + out.shape[1])
        if hi > lo:
            out[:, lo - first:hi - first] = samples_CN[:, lo - at:hi - at]
    return at + samples_CN.shape[1]


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """The ``[n_mels, n_fft // 2 + 1]`` Slaney-scale, Slaney-normalised triangular mel filterbank from 0 Hz to
    ``sample_rate / 2`` (torchaudio's ``melscale_fbanks(..., norm="slaney", mel_scale="slaney")``)."""

    def hz_to_mel(hz: np.ndarray) -> np.ndarray:
        hz = np.asarray(hz, np.float64)
        mel = hz / (200.0 / 3)
        log = hz >= 1000.0
        return np.where(log, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (math.log(6.4) / 27.0), mel)

    def mel_to_hz(mel: np.ndarray) -> np.ndarray:
        hz = mel * (200.0 / 3)
        return np.where(mel >= 15.0, 1000.0 * np.exp((math.log(6.4) / 27.0) * (mel - 15.0)), hz)

    freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    slopes = edges[None, :] - freqs[:, None]  # [freqs, n_mels + 2]
    widths = np.diff(edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    fb = np.maximum(0.0, np.minimum(down, up))  # [freqs, n_mels]
    fb *= 2.0 / (edges[2:n_mels + 2] - edges[:n_mels])  # Slaney: equal area per filter
    return torch.from_numpy(fb.T.astype(np.float32))


def log_mel(waveform_BCN: torch.Tensor, sample_rate: int, hop_length: int, n_mels: int,
            n_fft: int = 1024) -> torch.Tensor:
    """``[B, C, T, n_mels]`` log-mel spectrograms of ``[B, C, N]`` waveforms, as LTX-2's audio VAE was trained
    on: magnitude STFT (Hann window of ``n_fft``, centred, reflect-padded), Slaney mel filters, ``log(max(mel,
    1e-5))``; ``T = 1 + N // hop_length``."""
    batch, channels, n = waveform_BCN.shape
    flat = waveform_BCN.reshape(batch * channels, n).float()
    spec = torch.stft(flat, n_fft, hop_length=hop_length, win_length=n_fft, window=torch.hann_window(n_fft),
                      center=True, pad_mode="reflect", return_complex=True).abs()  # [BC, F, T]
    mel = slaney_mel_filters(sample_rate, n_fft, n_mels) @ spec
    return torch.log(mel.clamp(min=1e-5)).reshape(batch, channels, n_mels, -1).transpose(2, 3)


def clip_sounds(metas: dict[int, dict[str, Any]], sample_rate: int) -> dict[int, tuple[torch.Tensor, bool] | Exception]:
    """Each bucketed clip's sound (``[2, N]`` at ``sample_rate``, and whether its video has an audio track), each
    source video's track decoded in one pass for all its clips; the exception that quarantines a sample whose
    sound cannot be read (or an image: it has none)."""
    out: dict[int, tuple[torch.Tensor, bool] | Exception] = {}
    by_source: dict[str, list[int]] = {}
    for i, meta in metas.items():
        if meta.get("kind") != "video" or "clip" not in meta:
            out[i] = ValueError("an image has no sound; this family caches each clip's audio (train images with "
                                "another family, or leave them out of ingest.source)")
        else:
            by_source.setdefault(meta["source_uri"], []).append(i)
    for uri, indices in by_source.items():
        try:
            waves, track = read_audio(uri, [clip_span(metas[i]) for i in indices], sample_rate)
        except Exception as err:  # any unreadable track is quarantined, never fatal
            out.update({i: err for i in indices})
            continue
        out.update({i: (wave, track) for i, wave in zip(indices, waves)})
    return out
