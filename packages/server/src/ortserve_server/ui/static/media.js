// Media by the model's modalities: images and audio files as chat content parts, the
// microphone through a speech-to-text model, replies read aloud by a voice model.
import { API, call } from "./api.js";

const readAsDataURL = (file) =>
  new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });

const AUDIO_FORMATS = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/mpeg": "mp3", "audio/flac": "flac", "audio/ogg": "ogg" };

// A file as an OpenAI content part, or an Error saying why the model cannot take it.
export async function contentPart(file, takes) {
  if (file.type.startsWith("image/")) {
    if (!takes.has("image")) return new Error(`${file.name}: this model does not take images`);
    return { type: "image_url", image_url: { url: await readAsDataURL(file) } };
  }
  if (file.type.startsWith("audio/")) {
    if (!takes.has("audio")) return new Error(`${file.name}: this model does not take audio`);
    const format = AUDIO_FORMATS[file.type] ?? file.name.split(".").pop().toLowerCase();
    const data = (await readAsDataURL(file)).split(",", 2)[1];
    return { type: "input_audio", input_audio: { data, format } };
  }
  return new Error(`${file.name}: only images and audio files can be attached`);
}

// 16-bit PCM WAV of mono float samples (what the transcription route reads; browsers
// record WebM, which it does not).
function wav(samples, rate) {
  const buffer = new ArrayBuffer(44 + samples.length * 2);
  const view = new DataView(buffer);
  const text = (offset, s) => [...s].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  text(8, "WAVEfmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true);
  view.setUint16(22, 1, true);
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true);
  view.setUint16(32, 2, true);
  view.setUint16(34, 16, true);
  text(36, "data");
  view.setUint32(40, samples.length * 2, true);
  samples.forEach((s, i) => view.setInt16(44 + i * 2, Math.max(-1, Math.min(1, s)) * 0x7fff, true));
  return new Blob([buffer], { type: "audio/wav" });
}

// Records the microphone until stop() resolves with its WAV.
export async function record() {
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  const context = new AudioContext();
  await context.audioWorklet.addModule(new URL("./recorder-worklet.js", import.meta.url));
  const node = new AudioWorkletNode(context, "recorder");
  const chunks = [];
  node.port.onmessage = (event) => chunks.push(event.data);
  context.createMediaStreamSource(stream).connect(node);
  return {
    async stop() {
      stream.getTracks().forEach((track) => track.stop());
      await context.close();
      const samples = new Float32Array(chunks.reduce((n, c) => n + c.length, 0));
      chunks.reduce((offset, c) => (samples.set(c, offset), offset + c.length), 0);
      return wav(samples, context.sampleRate);
    },
  };
}

export async function transcribe(model, audio) {
  const form = new FormData();
  form.append("model", model);
  form.append("file", audio, "speech.wav");
  const response = await call(`${API}/audio/transcriptions`, { method: "POST", body: form });
  return (await response.json()).text;
}

let playing = null;
export async function speak(model, text) {
  playing?.pause();
  const response = await call(`${API}/audio/speech`, { json: { model, input: text, response_format: "wav" } });
  const url = URL.createObjectURL(await response.blob());
  playing = new Audio(url);
  playing.onended = () => URL.revokeObjectURL(url);
  await playing.play();
  return playing;
}
